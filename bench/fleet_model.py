"""A discrete-event model of a PD fleet of reference workers, for judging the autopilot at
fleet sizes no machine here can run as processes (issue 30, item 3b).

Every duration comes from the reference worker's timing model (:class:`pd_worker.timing.
TimingModel`), and the queues are the ones pd_worker keeps (``pd_worker/roles.py``):

- a prefill takes a request's prompt KV from its pool (FIFO), queues it, and runs one forward at
  a time over up to ``max_running_requests`` prompts within ``max_prefill_tokens``
  (``prefill_secs``); it holds the KV until the decode pulled it;
- a decode reserves prompt + answer tokens of KV (FIFO) as the request arrives, pulls the KV once
  the prefill's forward is done (``transfer_secs``), then waits for one of its
  ``max_running_requests`` batch slots; each step gives every running request one token and
  lasts ``decode_step_secs(batch, context tokens)``;
- the router sends each request to a prefill and a decode at once, each chosen by pd-router's
  own default policy (``least_inflight``: the less loaded of two drawn at random, by its
  in-flight counts); a prefill's in-flight count ends when its KV was pulled, a decode's with the
  answer;
- a conversion takes a worker out of its pool, waits for its in-flight requests to end, then
  ``switch_secs``, then it serves the new role.

Decode steps are simulated in runs: between two changes of a decode's batch (a request admitted
or finished) every step lasts the same plus the context it grew by, so a run of k steps is one
event whose end is known in closed form; a request that becomes ready while a batch slot is
free cuts the run at the next step boundary. That keeps an hour of traffic over hundreds of
workers to a few events per request.

When a policy is given, the fleet is sampled every ``interval_secs`` of modeled time into the
same :class:`~pd_router.control.autopilot.signals.Sample` the router's controller builds from
its registry, its latency rings and the workers' ``/v1/loads``, and the decisions it applies
convert workers as above.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from traces import TraceRequest

from pd_router.control.autopilot.policy import AutopilotPolicy, Decision
from pd_router.control.autopilot.signals import DECODE, PREFILL, ROLES, Sample, WorkerSignals
from pd_router.control.latency import (
    LatencyRecorder,
    percentile_ms,
    tpot_attained,
    ttft_attained,
)
from pd_router.dataplane.routing.policies import LeastInflightPolicy
from pd_worker.timing import TimingModel

ACTIVE, DRAINING, SWITCHING = "active", "draining", "switching"


class SimRequest:
    """One request's passage through the fleet (modeled seconds); ``error`` when refused."""

    __slots__ = (
        "decode",
        "done_step",
        "error",
        "first",
        "forwarded",
        "kv_in",
        "last",
        "output",
        "prefill",
        "prefilled_at",
        "prompt",
        "trace",
    )

    def __init__(self, trace: TraceRequest) -> None:
        self.trace = trace
        self.prompt = trace.prompt_tokens
        self.output = trace.output_tokens
        self.prefill: SimWorker | None = None
        self.decode: SimWorker | None = None
        self.forwarded = False
        self.kv_in = False
        self.prefilled_at = 0.0
        self.first: float | None = None
        self.last: float | None = None
        self.done_step = 0
        self.error: str | None = None

    def __lt__(self, other: SimRequest) -> bool:
        return self.trace.at < other.trace.at

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.trace.at

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        if self.first is None or self.last is None or self.output < 2:
            return None
        return (self.last - self.first) / (self.output - 1)


class SimWorker:
    """One reference worker: its KV pool and counters outlive role switches, as pd_worker's
    Engine does; the queues belong to its current role."""

    __slots__ = (
        "batch",
        "batch_tokens",
        "context",
        "held",
        "inflight",
        "kv_used",
        "kv_waiters",
        "moments",
        "pending",
        "pending_tokens",
        "prefill_busy_us",
        "prefill_tokens",
        "ready",
        "role",
        "run_a",
        "run_b",
        "run_c",
        "run_k",
        "run_start",
        "running",
        "state",
        "steps",
        "to_role",
        "transfer",
        "url",
        "version",
    )

    def __init__(self, url: str, role: str) -> None:
        self.url = url
        self.role = role
        self.state = ACTIVE
        self.inflight = 0
        self.kv_used = 0
        self.kv_waiters: deque[tuple[int, SimRequest, Callable[..., None]]] = deque()
        # prefill: prompts queued for a forward, the forward running, KV awaiting its pull
        self.pending: deque[SimRequest] = deque()
        self.pending_tokens = 0
        self.batch: list[SimRequest] = []
        self.batch_tokens = 0
        self.held = 0
        # decode: KV reserved awaiting the pull, KV in awaiting a slot, running (a heap by the
        # step they finish at), context tokens attended, steps taken, the current run of steps
        self.transfer = 0
        self.ready: deque[SimRequest] = deque()
        self.running: list[tuple[int, SimRequest]] = []
        self.context = 0
        self.steps = 0
        self.run_start = 0.0
        self.run_a = 0.0
        self.run_c = 0.0
        self.run_k = 0
        self.run_b = 0
        self.version = 0
        self.prefill_tokens = 0
        self.prefill_busy_us = 0
        self.moments = [0.0] * 6
        self.to_role = role

    def span(self, k: int) -> float:
        """Seconds the first ``k`` steps of the current run take (each grows by the context
        the batch added)."""
        return k * self.run_a + self.run_c * k * (k - 1) / 2

    def steps_within(self, secs: float) -> int:
        """Whole steps of the current run done ``secs`` after it started."""
        a, c = self.run_a, self.run_c
        if c <= 0:
            j = int(secs / a)
        else:
            half = a - c / 2
            j = int((-half + math.sqrt(half * half + 2 * c * secs)) / c)
        while j > 0 and self.span(j) > secs:
            j -= 1
        while self.span(j + 1) <= secs:
            j += 1
        return min(j, self.run_k)


@dataclass
class Conversion:
    """One conversion the policy applied: when it started and ended (None: still running)."""

    url: str
    from_role: str
    to_role: str
    started: float
    drained: float | None = None
    ended: float | None = None


@dataclass
class FleetResult:
    """What one run produced: every request, the conversions, the policy's converting
    decisions, the pool sizes after each sample's decision and, when kept, every sample with
    its decision."""

    requests: list[SimRequest]
    conversions: list[Conversion] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    pools: list[tuple[float, int, int]] = field(default_factory=list)
    ticks: list[tuple[Sample, Decision]] = field(default_factory=list)
    end: float = 0.0


class Fleet:
    """A fleet of ``prefills`` + ``decodes`` reference workers behind one router."""

    def __init__(
        self,
        timing: TimingModel,
        prefills: int,
        decodes: int,
        *,
        seed: int = 0,
        policy: AutopilotPolicy | None = None,
        keep_samples: bool = False,
    ) -> None:
        self.timing = timing
        self.workers = [SimWorker(f"sim://p{i}", PREFILL) for i in range(prefills)] + [
            SimWorker(f"sim://d{i}", DECODE) for i in range(decodes)
        ]
        self.by_url = {w.url: w for w in self.workers}
        self.active = {role: [w for w in self.workers if w.role == role] for role in ROLES}
        self.policy = policy
        self.keep_samples = keep_samples
        self.now = 0.0
        self._routing = LeastInflightPolicy(random.Random(seed))
        self._events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self.latency = LatencyRecorder()
        self._refused = dict.fromkeys(ROLES, 0)
        self._refused_seen = dict.fromkeys(ROLES, 0)
        self._open = 0
        self.result = FleetResult([])

    # --- the event loop ---------------------------------------------------------------------

    def at(self, when: float, handler: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``handler(arg)`` at modeled time ``when``."""
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, handler, arg))

    def run(self, trace: Sequence[TraceRequest]) -> FleetResult:
        """Replay ``trace`` (sorted by send time) until every request ended."""
        requests = [SimRequest(r) for r in trace]
        self.result.requests = requests
        self._open = len(requests)
        for request in requests:
            self.at(request.trace.at, self._arrive, request)
        if self.policy is not None:
            self.at(self.policy.config.interval_secs, self._tick)
        events = self._events
        while events:
            self.now, _, handler, arg = heapq.heappop(events)
            handler(arg)
        self.result.end = self.now
        return self.result

    # --- routing and KV ---------------------------------------------------------------------

    def _pick(self, role: str) -> SimWorker | None:
        """The router's choice in the pool: its own least_inflight policy (the less loaded
        of two workers drawn at random)."""
        pool = self.active[role]
        return self._routing.select(pool) if pool else None  # type: ignore[arg-type]

    def _arrive(self, req: SimRequest) -> None:
        prefill, decode = self._pick(PREFILL), self._pick(DECODE)
        if prefill is None or decode is None:
            role = PREFILL if prefill is None else DECODE
            self._refused[role] += 1
            req.error = f"no {role} worker"
            self._open -= 1
            return
        req.prefill, req.decode = prefill, decode
        prefill.inflight += 1
        decode.inflight += 1
        self._acquire(prefill, req.prompt, req, self._queue_prompt)
        self._acquire(decode, req.prompt + req.output, req, self._kv_reserved)

    def _acquire(
        self, worker: SimWorker, tokens: int, req: SimRequest, then: Callable[..., None]
    ) -> None:
        """Take ``tokens`` of the worker's KV, waiting in FIFO order while it is full."""
        if not worker.kv_waiters and worker.kv_used + tokens <= self.timing.max_total_num_tokens:
            worker.kv_used += tokens
            then(worker, req)
        else:
            worker.kv_waiters.append((tokens, req, then))

    def _release(self, worker: SimWorker, tokens: int) -> None:
        worker.kv_used -= tokens
        capacity = self.timing.max_total_num_tokens
        waiters = worker.kv_waiters
        while waiters and worker.kv_used + waiters[0][0] <= capacity:
            need, req, then = waiters.popleft()
            worker.kv_used += need
            then(worker, req)

    # --- prefill ----------------------------------------------------------------------------

    def _queue_prompt(self, prefill: SimWorker, req: SimRequest) -> None:
        prefill.pending.append(req)
        prefill.pending_tokens += req.prompt
        if not prefill.batch:
            self._forward(prefill)

    def _forward(self, prefill: SimWorker) -> None:
        """Start the next forward: queued prompts in order, within the batch caps."""
        timing = self.timing
        batch: list[SimRequest] = []
        tokens = 0
        pending = prefill.pending
        while pending and len(batch) < timing.max_running_requests:
            prompt = pending[0].prompt
            if batch and tokens + prompt > timing.max_prefill_tokens:
                break
            batch.append(pending.popleft())
            tokens += prompt
        prefill.batch = batch
        prefill.batch_tokens = tokens
        prefill.pending_tokens -= tokens
        self.at(self.now + timing.prefill_secs(tokens), self._forward_done, prefill)

    def _forward_done(self, prefill: SimWorker) -> None:
        tokens = prefill.batch_tokens
        prefill.prefill_tokens += tokens
        prefill.prefill_busy_us += round(self.timing.prefill_secs(tokens) * 1e6)
        batch, prefill.batch = prefill.batch, []
        for req in batch:
            req.forwarded = True
            prefill.held += 1
            if req.kv_in:
                self._pull(req)
        if prefill.pending:
            self._forward(prefill)

    def _kv_reserved(self, decode: SimWorker, req: SimRequest) -> None:
        decode.transfer += 1
        req.kv_in = True
        if req.forwarded:
            self._pull(req)

    def _pull(self, req: SimRequest) -> None:
        self.at(self.now + self.timing.transfer_secs(req.prompt), self._pulled, req)

    def _pulled(self, req: SimRequest) -> None:
        """The KV is at the decode: the prefill answers the router and frees it."""
        prefill, decode = req.prefill, req.decode
        assert prefill is not None and decode is not None
        prefill.held -= 1
        prefill.inflight -= 1
        self._release(prefill, req.prompt)
        req.prefilled_at = self.now
        if prefill.state == DRAINING:
            self._check_drained(prefill)
        decode.transfer -= 1
        decode.ready.append(req)
        if decode.run_k == 0:
            self._step_run(decode)
        elif len(decode.running) < self.timing.max_running_requests:
            self._cut(decode)

    # --- decode -----------------------------------------------------------------------------

    def _step_run(self, decode: SimWorker) -> None:
        """Admit ready requests into free slots and start the run of steps that lasts until
        the next request finishes."""
        timing = self.timing
        running = decode.running
        ready = decode.ready
        fresh = []
        while ready and len(running) < timing.max_running_requests:
            req = ready.popleft()
            req.done_step = decode.steps + req.output
            heapq.heappush(running, (req.done_step, req))
            decode.context += req.prompt
            fresh.append(req)
        if not running:
            decode.run_k = 0
            return
        b = len(running)
        decode.run_start = self.now
        decode.run_b = b
        decode.run_a = timing.decode_step_secs(b, decode.context)
        decode.run_c = timing.decode_step_per_ctx_token_secs * b
        decode.run_k = running[0][0] - decode.steps
        decode.version += 1
        first = self.now + decode.run_a
        for req in fresh:
            self._first_token(req, first)
        self.at(self.now + decode.span(decode.run_k), self._run_done, (decode, decode.version))

    def _cut(self, decode: SimWorker) -> None:
        """End the current run at the next step boundary, so a request just ready takes a
        free slot there."""
        j = decode.steps_within(self.now - decode.run_start)
        if decode.span(j) < self.now - decode.run_start:
            j += 1
        j = max(j, 1)
        if j < decode.run_k:
            decode.run_k = j
            decode.version += 1
            self.at(decode.run_start + decode.span(j), self._run_done, (decode, decode.version))

    def _run_done(self, arg: tuple[SimWorker, int]) -> None:
        decode, version = arg
        if version != decode.version:
            return
        k, b = decode.run_k, decode.run_b
        secs = decode.span(k)
        add_moments(decode.moments, k, b, secs)
        decode.steps += k
        decode.context += b * k
        running = decode.running
        while running and running[0][0] <= decode.steps:
            _, req = heapq.heappop(running)
            self._finish(decode, req)
        decode.run_k = 0
        self._step_run(decode)

    def _first_token(self, req: SimRequest, first: float) -> None:
        """The router's TTFT observation, split where the prefill answered."""
        req.first = first
        arrival = req.trace.at
        self.latency.prefill.append((first, req.prefilled_at - arrival))
        self.latency.decode_wait.append((first, first - req.prefilled_at))

    def _finish(self, decode: SimWorker, req: SimRequest) -> None:
        req.last = self.now
        decode.context -= req.prompt + req.output
        decode.inflight -= 1
        self._open -= 1
        tpot = req.tpot
        if tpot is not None:
            self.latency.tpot.append((self.now, tpot))
        self._release(decode, req.prompt + req.output)
        if decode.state == DRAINING:
            self._check_drained(decode)

    # --- conversions ------------------------------------------------------------------------

    def convert(self, url: str, to_role: str) -> Conversion | None:
        """Take the worker out of its pool to serve ``to_role`` once drained and switched; None
        when it is not an active worker of the other role."""
        worker = self.by_url.get(url)
        if worker is None or worker.state != ACTIVE or worker.role == to_role:
            return None
        worker.state = DRAINING
        worker.to_role = to_role
        self.active[worker.role].remove(worker)
        conversion = Conversion(url, worker.role, to_role, self.now)
        self.result.conversions.append(conversion)
        self._check_drained(worker)
        return conversion

    def _check_drained(self, worker: SimWorker) -> None:
        if worker.inflight == 0:
            worker.state = SWITCHING
            self._conversion(worker).drained = self.now
            self.at(self.now + self.timing.switch_secs, self._switched, worker)

    def _switched(self, worker: SimWorker) -> None:
        worker.role = worker.to_role
        worker.state = ACTIVE
        self.active[worker.role].append(worker)
        self._conversion(worker).ended = self.now

    def _conversion(self, worker: SimWorker) -> Conversion:
        return next(c for c in reversed(self.result.conversions) if c.url == worker.url)

    def converting(self) -> bool:
        return any(w.state != ACTIVE for w in self.workers)

    # --- sampling ---------------------------------------------------------------------------

    def _tick(self, _: Any) -> None:
        """One autopilot interval: sample, decide, act on what it applies."""
        policy = self.policy
        assert policy is not None
        sample = self.sample(policy.config.window_secs)
        decision = policy.step(sample)
        if self.keep_samples:
            self.result.ticks.append((sample, decision))
        if decision.converts:
            self.result.decisions.append(decision)
        if decision.applied and decision.to_role is not None:
            for worker in decision.workers:
                self.convert(worker, decision.to_role)
        self.result.pools.append((self.now, len(self.active[PREFILL]), len(self.active[DECODE])))
        if self._open > 0 or self.converting():
            self.at(self.now + policy.config.interval_secs, self._tick)

    def sample(self, window_secs: float) -> Sample:
        """What the router's controller samples now: its ACTIVE workers' loads and in-flight
        counts, its latency rings over ``window_secs``, refusals since the last sample."""
        config = self.policy.config if self.policy is not None else None
        since = self.now - window_secs
        ttft_slo = config.ttft_slo_ms if config else None
        tpot_slo = config.tpot_slo_ms if config else None
        latency = self.latency
        refused = {r: n - self._refused_seen[r] for r, n in self._refused.items()}
        self._refused_seen = dict(self._refused)
        return Sample(
            at=self.now,
            workers=tuple(self.signals(w) for w in self.workers if w.state == ACTIVE),
            prefill_p90_ms=percentile_ms(latency.prefill, since),
            decode_wait_p90_ms=percentile_ms(latency.decode_wait, since),
            tpot_p90_ms=percentile_ms(latency.tpot, since),
            no_worker_503s={r: n for r, n in refused.items() if n > 0},
            converting=self.converting(),
            ttft_attained=None if ttft_slo is None else ttft_attained(latency, since, ttft_slo),
            tpot_attained=None if tpot_slo is None else tpot_attained(latency, since, tpot_slo),
        )

    def signals(self, worker: SimWorker) -> WorkerSignals:
        """The worker as ``worker_from_loads`` reads pd_worker's ``/v1/loads``: a prefill's
        waiting are its prompts not in a forward (``queues.waiting`` too), its queued tokens
        those awaiting a forward; a decode's waiting are those reserving KV, pulling it or
        waiting for a slot, the last its ``queues.waiting``. The moments count the steps of
        the current run done by now."""
        capacity = self.timing.max_total_num_tokens
        if worker.role == PREFILL:
            running = len(worker.batch)
            waiting = len(worker.pending) + len(worker.kv_waiters)
            for_slot, queued = waiting, worker.pending_tokens
        else:
            running = len(worker.running)
            for_slot = len(worker.ready)
            waiting = len(worker.kv_waiters) + worker.transfer + for_slot
            queued = 0
        return WorkerSignals(
            url=worker.url,
            role=worker.role,
            inflight=worker.inflight,
            running=running,
            waiting=waiting,
            token_usage=worker.kv_used / capacity,
            used_tokens=worker.kv_used,
            queued_prefill_tokens=queued,
            max_running=self.timing.max_running_requests,
            waiting_for_slot=for_slot,
            prefill_tokens=worker.prefill_tokens,
            prefill_busy_us=worker.prefill_busy_us,
            decode_moments=self._moments_now(worker),
        )

    def _moments_now(self, worker: SimWorker) -> tuple[float, ...]:
        moments = list(worker.moments)
        if worker.run_k > 0:
            k = worker.steps_within(self.now - worker.run_start)
            add_moments(moments, k, worker.run_b, worker.span(k))
        return tuple(moments) if moments[0] > 0 else ()


def add_moments(moments: list[float], k: int, b: int, secs: float) -> None:
    """Add ``k`` decode steps of batch ``b`` lasting ``secs`` in all to SGLang's moment sums
    ``[n, Σb, Σt, Σb², Σb·t, Σg]`` (t in microseconds)."""
    us = secs * 1e6
    moments[0] += k
    moments[1] += k * b
    moments[2] += us
    moments[3] += k * b * b
    moments[4] += b * us
    moments[5] += k * b
