"""Reading what each worker reports about its own load (``GET /v1/loads?include=core``), for
the pools whose policy needs it (``least_load``); a router whose policies do not runs none.

A round reads every ACTIVE, healthy worker of those pools at once, each call bounded by
:data:`CALL_TIMEOUT_SECS`, and hands each answer to the registry
(:meth:`~pd_router.control.workers.WorkerRegistry.set_load_report`), the one place the reports
land: a worker that does not answer in time, or answers something else than SGLang's shape,
has no report (its policy judges it by the router's in-flight count) until it answers again. A
feed the engines push (sglang #32925, per-rank loads) would replace this module by calling the
same method; the data planes' policies read the registry's reports (through the publisher).
The autopilot reads each worker's whole ``/v1/loads`` (its capacity counters, its queues) once
per sample on its own interval (:mod:`pd_router.control.autopilot.controller`): the same
numbers, not the same reading.

The interval adapts: while the reports move (a worker's running + waiting changed, or a worker
gained or lost its report) the next round comes after :data:`MIN_INTERVAL_SECS`; each round that
finds every report as it was doubles the wait, up to :data:`MAX_INTERVAL_SECS`. Between two
reports the policy adds the requests it sent since (:mod:`pd_router.dataplane.routing.policies`),
so a steady fleet costs a call per worker a second and a moving one is read ten times
a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

import aiohttp
import orjson

from pd_router.control.load_report import BadLoadReport, LoadReport, parse_loads
from pd_router.control.workers import Worker, WorkerRegistry, WorkerState
from pd_router.roles import Role

log = logging.getLogger("pd_router.load_poller")

MIN_INTERVAL_SECS = 0.1
MAX_INTERVAL_SECS = 1.0
CALL_TIMEOUT_SECS = 0.5
LOADS_PATH = "/v1/loads?include=core"


def next_interval(interval: float, moved: bool) -> float:
    """The wait before the next round: the shortest while the reports move, else twice the
    last one, up to the longest."""
    if moved:
        return MIN_INTERVAL_SECS
    return min(MAX_INTERVAL_SECS, interval * 2)


def moved(before: LoadReport | None, after: LoadReport | None) -> bool:
    """Whether a worker's report moved: it gained or lost one, or its requests changed."""
    if before is None or after is None:
        return before is not after
    return before.requests != after.requests


class LoadPoller:
    """Reads the load reports of the workers in ``roles`` into ``registry``, on ``session``
    (the shared one: the workers' headers and TLS)."""

    def __init__(
        self, registry: WorkerRegistry, session: aiohttp.ClientSession, roles: Iterable[Role]
    ) -> None:
        self._registry = registry
        self._session = session
        self.roles = frozenset(roles)
        self._task: asyncio.Task[None] | None = None
        self._timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_SECS)

    def run_in_background(self) -> None:
        """Start the rounds (the caller starts none when no pool needs the reports)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = MIN_INTERVAL_SECS
        while True:
            interval = next_interval(interval, await self.poll_once())
            await asyncio.sleep(interval)

    async def poll_once(self) -> bool:
        """One round: read every polled worker at once; a worker no longer polled (it left
        the pools or the service) loses its report. Returns whether any report moved."""
        polled = []
        changed = False
        for worker in self._registry:
            if worker.role in self.roles and worker.state is WorkerState.ACTIVE and worker.healthy:
                polled.append(worker)
            elif worker.load_report is not None:
                self._registry.set_load_report(worker, None)
                changed = True
        reports = await asyncio.gather(*(self._read(worker) for worker in polled))
        for worker, report in zip(polled, reports, strict=True):
            changed |= moved(worker.load_report, report)
            self._registry.set_load_report(worker, report)
        return changed

    async def _read(self, worker: Worker) -> LoadReport | None:
        """The worker's report, or None when it does not answer in time or not as SGLang."""
        try:
            async with self._session.get(worker.url + LOADS_PATH, timeout=self._timeout) as resp:
                if resp.status != 200:
                    return None
                body = orjson.loads(await resp.read())
            return parse_loads(body, time.monotonic())
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, BadLoadReport) as exc:
            log.debug("no load report from %s: %s", worker.url, exc)
            return None
