"""Health probes on an interval, with failure and success thresholds.

A worker turns unhealthy after ``failure_threshold`` failed probes in a row and healthy again
after ``success_threshold`` good ones, so one lost probe does not flap the pools. The first probe
of a worker decides at once (at start-up an unreachable worker is registered unhealthy and is
picked up when it comes up). A prefill whose bootstrap port is unknown gets it from its
``/server_info`` before it counts as healthy. Workers in the middle of a role switch are left to
the conversion manager.

A worker that turns healthy may be a restarted process: SGLang comes back in the role it was
launched with, which is not the pool a conversion put it in. So before it counts as healthy its
live role is read, and a worker in the wrong pool is moved (with its bootstrap port) first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import aiohttp
import orjson

from pd_router.config import HealthConfig
from pd_router.control import ControlError, WorkerControl
from pd_router.workers import DEFAULT_BOOTSTRAP_PORT, Role, Worker, WorkerRegistry, WorkerState

log = logging.getLogger("pd_router.health")


@dataclass
class ProbeRecord:
    successes: int = 0
    failures: int = 0
    probed: bool = False


class HealthMonitor:
    """Probes every worker's health endpoint and feeds the registry."""

    def __init__(self, registry: WorkerRegistry, config: HealthConfig) -> None:
        self._registry = registry
        self._config = config
        self._records: dict[str, ProbeRecord] = {}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    def run_in_background(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._config.interval_secs)
            await self.probe_all()

    async def probe_all(self) -> None:
        workers = [w for w in self._registry if w.state is not WorkerState.SWITCHING]
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))
        known = {w.id for w in self._registry}
        for worker_id in [k for k in self._records if k not in known]:
            del self._records[worker_id]

    async def check(self, worker: Worker) -> bool:
        """Probe ``worker`` once and apply the thresholds; returns the worker's health."""
        ok, error = await self._probe(worker)
        record = self._records.setdefault(worker.id, ProbeRecord())
        if ok:
            record.successes += 1
            record.failures = 0
        else:
            record.failures += 1
            record.successes = 0
        first = not record.probed
        record.probed = True
        if (
            worker.healthy
            and not ok
            and (first or record.failures >= self._config.failure_threshold)
        ):
            log.warning("worker unhealthy", extra={"worker": worker.url, "error": error})
            self._registry.set_health(worker, False, error)
        elif (
            not worker.healthy
            and ok
            and (first or record.successes >= self._config.success_threshold)
        ):
            error = await self._adopt_live_role(worker)
            if error is not None:
                self._registry.note_error(worker, error)
                return False
            log.info("worker healthy", extra={"worker": worker.url})
            self._registry.set_health(worker, True)
        elif not ok and error is not None:
            self._registry.note_error(worker, error)
        return worker.healthy

    async def _adopt_live_role(self, worker: Worker) -> str | None:
        """Put a recovering ACTIVE worker in the pool of the role it reports (``/pd_role``, else
        ``/server_info``); returns an error when the role cannot be read (it stays unhealthy).
        A worker that reports no role (no PD support) stays where it was registered; one in its
        registered role keeps its bootstrap port (a port given on the command line wins)."""
        if worker.state is not WorkerState.ACTIVE:
            return None
        self._registry.set_extensions(worker, None)
        control = WorkerControl(
            self._session, self._registry, timeout_secs=self._config.timeout_secs
        )
        try:
            reading = await control.read_role(worker)
        except ControlError as exc:
            return f"reading the live role failed: {exc}"
        if worker.state is not WorkerState.ACTIVE:
            return None  # a conversion took the worker while its role was read: it owns it now
        port = reading.bootstrap_port if reading.role is Role.PREFILL else None
        if reading.role is not None and reading.role is not worker.role:
            log.warning(
                "worker came back in another role; moving it",
                extra={"worker": worker.url, "from": worker.role.value, "to": reading.role.value},
            )
            self._registry.adopt_role(worker, reading.role, port)
        return None

    async def _probe(self, worker: Worker) -> tuple[bool, str | None]:
        if self._session is None:
            raise RuntimeError("health monitor not started")
        timeout = aiohttp.ClientTimeout(total=self._config.timeout_secs)
        try:
            async with self._session.get(
                worker.url + self._config.endpoint, timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    return False, f"health probe answered {resp.status}"
            if worker.role is Role.PREFILL and worker.bootstrap_port is None:
                port = await self._bootstrap_port(worker, timeout)
                self._registry.set_bootstrap_port(worker, port)
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
            return False, f"health probe failed: {type(exc).__name__}: {exc}"
        return True, None

    async def _bootstrap_port(self, worker: Worker, limit: aiohttp.ClientTimeout) -> int:
        """The prefill's ``disaggregation_bootstrap_port`` from /server_info (8998 if absent)."""
        async with self._session.get(worker.url + "/server_info", timeout=limit) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message="server_info failed"
                )
            info = orjson.loads(await resp.read())
        port = info.get("disaggregation_bootstrap_port") if isinstance(info, dict) else None
        return (
            port if isinstance(port, int) and not isinstance(port, bool) else DEFAULT_BOOTSTRAP_PORT
        )
