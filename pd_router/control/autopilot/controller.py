"""The autopilot's controller: samples the router and the workers on an interval, feeds the
policy, keeps its last decisions, and in ``auto`` mode starts the conversions it decides.

Each model served in PD has its own pilot (:class:`ModelPilot`: a policy, its decisions, what
it last saw): its pools, its requests' latencies and its refusals are its own, and a
conversion it decides moves a worker between that model's pools only. Regular workers have no
pilot: they have nothing to convert.

A sample reads the registry (ACTIVE, healthy workers of each pool and the router's in-flight
count on each), every one of those workers' ``GET /v1/loads`` over the router's shared session
(a worker that does not answer within the health timeout counts with its router-side figures
only), and the request path's latency rings. Conversions go through the ConversionManager like
an operator's, so its invariants (one per worker, the global cap, minimum pools) hold here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from pd_router.config import build_autopilot
from pd_router.control.autopilot.policy import (
    ACTIONS,
    AutopilotConfig,
    AutopilotPolicy,
    Decision,
)
from pd_router.control.autopilot.signals import ROLES, Sample, WorkerSignals, worker_from_loads
from pd_router.control.conversion.history import ConversionRequest
from pd_router.control.errors import ClusterUnavailable, ConversionRefused, WorkerUnreachable
from pd_router.control.latency import (
    Latencies,
    LatencyRecorder,
    percentile_ms,
    tpot_attained,
    ttft_attained,
)
from pd_router.control.worker_calls import call
from pd_router.control.workers import RegistryError, Role, Worker, WorkerState
from pd_router.roles import PD_ROLES

if TYPE_CHECKING:
    from pd_router.config import RouterConfig
    from pd_router.control.conversion.manager import ConversionManager
    from pd_router.control.workers import WorkerRegistry
    from pd_router.metrics import RouterMetrics

log = logging.getLogger("pd_router.autopilot")

LOADS_PATH = "/v1/loads"


def conversions_for(decision: Decision) -> list[ConversionRequest]:
    """The conversions a decision asks for: none when it holds or its mode only recommends."""
    if not decision.applied or decision.to_role is None:
        return []
    role = Role(decision.to_role)
    return [
        ConversionRequest(worker=url, new_role=role, started_by="autopilot")
        for url in decision.workers
    ]


class ModelPilot:
    """The autopilot of one model's pools: its policy, its decisions, what it last saw."""

    def __init__(self, model: str, config: RouterConfig, autopilot: AutopilotConfig) -> None:
        conversion = config.conversion
        self.model = model
        self.policy = AutopilotPolicy(
            autopilot,
            conversion.min_prefill,
            conversion.min_decode,
            max_moves=conversion.max_concurrent,
        )
        # Conversions decided (applied or recommended), oldest first; holds are only kept as
        # the latest decision, or the history would be a column of "within target".
        self.decisions: deque[Decision] = deque(maxlen=autopilot.history)
        self.last_decision: Decision | None = None
        self.last_sample: Sample | None = None
        self.last_error: str | None = None
        self.refused_seen: dict[str, int] = {}

    def reconfigure(self, config: AutopilotConfig) -> None:
        self.policy.reconfigure(config)
        if config.history != self.decisions.maxlen:
            self.decisions = deque(self.decisions, maxlen=config.history)

    def to_json(self) -> dict[str, Any]:
        last = self.last_decision
        return {
            "loads": {role: load.to_json() for role, load in self.policy.loads.items()},
            "last_sample": self.last_sample.to_json() if self.last_sample else None,
            "last_error": self.last_error,
            "last_judgement": self.policy.last_judgement,
            "last_decision": decision_json(last) if last else None,
            "decisions": [decision_json(d) for d in reversed(self.decisions)],
        }


class Autopilot:
    """One per router; runs from ``Router.start`` to ``Router.stop``."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        latency: Latencies,
        metrics: RouterMetrics,
        *,
        session: aiohttp.ClientSession,
        conversions: ConversionManager,
        is_leader: Callable[[], bool],
    ) -> None:
        """``session`` is the router's shared client session (the workers' loads are read on
        it), ``conversions`` runs what the autopilot decides, ``is_leader`` says whether this
        replica runs the autopilot of its cluster."""
        self._registry = registry
        self._latency = latency
        self._metrics = metrics
        self._session = session
        self._conversions = conversions
        self._is_leader = is_leader
        self._probe_timeout = aiohttp.ClientTimeout(total=config.health.timeout_secs)
        self._router_config = config
        self._config = config.autopilot
        self._pilots: dict[str, ModelPilot] = {}
        self._task: asyncio.Task | None = None
        # Every action's series exists at 0 from the start: a counter series that first
        # appears at 1 is invisible to increase(), so the first conversion would not show.
        for action in ACTIONS:
            metrics.autopilot_decisions_total.labels(action)

    @property
    def config(self) -> AutopilotConfig:
        return self._config

    def configure(self, changes: dict[str, Any]) -> AutopilotConfig:
        """Apply ``PUT /autopilot`` changes (mode, targets, ...) to every model's pilot,
        validated like the config file; ConfigError names the offending key."""
        config = build_autopilot({**dataclasses.asdict(self.config), **changes})
        self._config = config
        for pilot in self._pilots.values():
            pilot.reconfigure(config)
        log.info("autopilot configured", extra={"mode": config.mode})
        return config

    def pilots(self) -> list[ModelPilot]:
        """A pilot per model served in PD (made as a model appears)."""
        pilots = []
        for model in self._registry.models():
            if not any(self._registry.in_role(role, model=model) for role in PD_ROLES):
                continue
            pilot = self._pilots.get(model)
            if pilot is None:
                pilot = self._pilots[model] = ModelPilot(model, self._router_config, self.config)
            pilots.append(pilot)
        return pilots

    @property
    def decisions(self) -> list[Decision]:
        """The conversions every model's pilot decided, oldest first."""
        return sorted((d for p in self._pilots.values() for d in p.decisions), key=lambda d: d.at)

    @property
    def last_decision(self) -> Decision | None:
        """The latest decision of any model's pilot."""
        decisions = [p.last_decision for p in self._pilots.values() if p.last_decision]
        return max(decisions, key=lambda d: d.at) if decisions else None

    # --- lifecycle --------------------------------------------------------------------------

    def run_in_background(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        """One tick per interval, on the cluster's leader only: replicas that each rebalanced
        would convert the same pools several times over."""
        while True:
            await asyncio.sleep(self.config.interval_secs)
            if self.config.mode != "off" and self._is_leader():
                await self.tick()

    # --- one interval -----------------------------------------------------------------------

    async def tick(self) -> list[Decision]:
        """Sample, decide, record, and act when the mode says so: for each model's pools."""
        decisions = []
        for pilot in self.pilots():
            sample = await self.sample(pilot)
            decision = pilot.policy.step(sample)
            pilot.last_sample = sample
            self._record(pilot, decision)
            for request in conversions_for(decision):
                await self._start(pilot, request)
            decisions.append(decision)
        return decisions

    async def sample(self, pilot: ModelPilot) -> Sample:
        """What ``pilot``'s model's pools look like now: its workers, its requests' latencies."""
        pools = [
            w
            for role in PD_ROLES
            for w in self._registry.in_role(role, (WorkerState.ACTIVE,), pilot.model)
            if w.healthy and w.admitting
        ]
        workers = await asyncio.gather(*(self._worker_signals(w) for w in pools))
        config = self.config
        since = time.monotonic() - config.window_secs
        latency = self._latency.of(pilot.model)
        ttft_slo, tpot_slo = config.ttft_slo_ms, config.tpot_slo_ms
        return Sample(
            at=time.monotonic(),
            workers=tuple(workers),
            prefill_p90_ms=percentile_ms(latency.prefill, since),
            decode_wait_p90_ms=percentile_ms(latency.decode_wait, since),
            tpot_p90_ms=percentile_ms(latency.tpot, since),
            no_worker_503s=self._new_refusals(pilot, latency),
            converting=bool(self._registry.converting()) or bool(self._conversions.active()),
            ttft_attained=None if ttft_slo is None else ttft_attained(latency, since, ttft_slo),
            tpot_attained=None if tpot_slo is None else tpot_attained(latency, since, tpot_slo),
        )

    async def _worker_signals(self, worker: Worker) -> WorkerSignals:
        role, inflight = worker.role.value, worker.inflight
        reply = await call(self._session, worker, "GET", LOADS_PATH, limit=self._probe_timeout)
        try:
            body = orjson.loads(reply.body) if reply.status == 200 else None
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            return WorkerSignals(worker.url, role, inflight=inflight)
        return worker_from_loads(worker.url, role, inflight, body)

    @staticmethod
    def _new_refusals(pilot: ModelPilot, latency: LatencyRecorder) -> dict[str, int]:
        counts = dict(latency.refused)
        seen = pilot.refused_seen
        new = {role: counts.get(role, 0) - seen.get(role, 0) for role in ROLES}
        pilot.refused_seen = counts
        return {role: n for role, n in new.items() if n > 0}

    def _record(self, pilot: ModelPilot, decision: Decision) -> None:
        pilot.last_decision = decision
        if decision.converts:
            pilot.decisions.append(decision)
        metrics = self._metrics
        metrics.autopilot_decisions_total.labels(decision.action).inc()
        for role, count in decision.desired.items():
            metrics.autopilot_desired_workers.labels(role, pilot.model).set(count)
        if decision.converts:
            log.info(
                "autopilot decision",
                extra={
                    "model": pilot.model,
                    "action": decision.action,
                    "worker": decision.worker,
                    "mode": decision.mode,
                    "reason": decision.reason,
                },
            )

    async def _start(self, pilot: ModelPilot, request: ConversionRequest) -> None:
        try:
            conversion = await self._conversions.start(request)
        except (ConversionRefused, WorkerUnreachable, ClusterUnavailable, RegistryError) as exc:
            pilot.last_error = f"conversion of {request.worker} refused: {exc}"
            log.warning("autopilot conversion refused", extra={"error": pilot.last_error})
            return
        pilot.last_error = None
        log.info("autopilot started conversion", extra={"conversion": conversion.id})

    def to_json(self) -> dict[str, Any]:
        """What ``GET /autopilot`` answers: mode, targets, and for its model's pools (one
        model) or for each model (``models``, several), the loads and the last sample it saw,
        its latest decision and the conversions it decided (newest first)."""
        pilots = self.pilots()
        config = self.config
        state: dict[str, Any] = {"mode": config.mode, "config": dataclasses.asdict(config)}
        if len(pilots) == 1:
            return {**state, **pilots[0].to_json()}
        empty = ModelPilot("", self._router_config, config).to_json()
        return {**state, **empty, "models": {p.model: p.to_json() for p in pilots}}


def decision_json(decision: Decision) -> dict[str, Any]:
    """A decision with its wall-clock ``time`` (the policy runs on the monotonic clock)."""
    wall = time.time() - (time.monotonic() - decision.at)
    return {**decision.to_json(), "time": round(wall, 3)}
