"""Bring a replica's registry in line with the cluster's shared worker records.

Each record says a worker's pool, state, epoch and which conversion holds it. Applying one:
a worker not known here is added (unhealthy until this replica's own probe passes); a worker a
peer's conversion holds is held here too (out of selection), and once this replica has no
request left in flight on it, it reports so; the end of that conversion moves the worker to its
new pool; a worker being removed or whose record went leaves this replica's pools once its
in-flight requests here ended. A worker this replica's own conversion holds is left to that
conversion, which publishes its outcome itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pd_protocol.cluster import WorkerRecord
from pd_router.control.cluster.view import ClusterView
from pd_router.control.workers import (
    CONVERTING,
    RegistryError,
    Role,
    UnknownWorker,
    Worker,
    WorkerRegistry,
    WorkerState,
)

log = logging.getLogger("pd_router.cluster")

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]


class Mirror:
    def __init__(
        self,
        registry: WorkerRegistry,
        replica_id: str,
        *,
        probe: Callable[[Worker], Awaitable[None]],
        report_drained: Callable[[str], Awaitable[None]],
        spawn: Spawn,
        removal_timeout_secs: float,
    ) -> None:
        self._registry = registry
        self._replica_id = replica_id
        self._probe = probe
        self._report_drained = report_drained
        self._spawn = spawn
        self._removal_timeout = removal_timeout_secs
        # Conversions this replica runs: their workers follow the conversion, not the record.
        self.own_conversions: set[str] = set()
        self._reporting: dict[str, asyncio.Task] = {}

    def sync_all(self, view: ClusterView) -> None:
        """After a full read: every record applied, every worker without one removed."""
        for url in list(view.records):
            self.changed(url, view)
        for worker in self._registry:
            if worker.url not in view.records:
                self._remove(worker)

    def changed(self, url: str, view: ClusterView) -> None:
        stored = view.records.get(url)
        worker = self._lookup(url)
        try:
            if stored is None:
                if worker is not None:
                    self._remove(worker)
            else:
                self._apply(worker, stored.record)
        except RegistryError as exc:
            log.warning("cluster record of %s not applied here: %s", url, exc)

    # --- one record -------------------------------------------------------------------------

    def _apply(self, worker: Worker | None, record: WorkerRecord) -> None:
        if record.state == WorkerState.REMOVING:
            if worker is not None:
                self._remove(worker)
            return
        role = Role(record.role)
        port = record.bootstrap_port if role is Role.PREFILL else None
        if worker is None:
            worker = self._registry.add(record.url, role, port, healthy=False)
            self._spawn(self._probe(worker))
            log.info("worker %s joined from the cluster as %s", worker.url, role.value)
        if worker.state is WorkerState.REMOVING or worker.conversion_id in self.own_conversions:
            return
        if record.conversion is not None and record.owner != self._replica_id:
            self._hold(worker, record)
            return
        state = WorkerState(record.state)
        if worker.conversion_id is not None:
            self._stop_reporting(worker.conversion_id)
            self._registry.release_from_peer(
                worker, worker.conversion_id, state, role=role, bootstrap_port=port,
                epoch=record.epoch,
            )  # fmt: skip
        elif state is WorkerState.FAILED and worker.state is WorkerState.ACTIVE:
            # A peer's conversion failed the worker before this replica saw it held.
            self._registry.hold_for_peer(worker, "cluster", WorkerState.DRAINING)
            self._registry.release_from_peer(
                worker, "cluster", state, role=role, bootstrap_port=port, epoch=record.epoch
            )
        elif state is WorkerState.ACTIVE and worker.state is WorkerState.FAILED:
            self._registry.add(worker.url, role, port, healthy=False)
            self._spawn(self._probe(worker))
        elif (role, port, record.epoch) != (worker.role, worker.bootstrap_port, worker.epoch):
            self._registry.follow_peer(
                worker, role=role, bootstrap_port=port or worker.bootstrap_port,
                epoch=record.epoch,
            )  # fmt: skip

    def _hold(self, worker: Worker, record: WorkerRecord) -> None:
        """A peer's conversion holds the worker: out of selection here, drained and reported."""
        conversion = record.conversion or ""
        state = WorkerState(record.state)
        if state not in CONVERTING:
            return
        self._registry.hold_for_peer(worker, conversion, state)
        if state is WorkerState.DRAINING and conversion not in self._reporting:
            self._reporting[conversion] = self._spawn(self._drain_and_report(worker, conversion))

    async def _drain_and_report(self, worker: Worker, conversion: str) -> None:
        await worker.wait_until_no_inflight()
        await self._report_drained(conversion)

    def _stop_reporting(self, conversion: str) -> None:
        task = self._reporting.pop(conversion, None)
        if task is not None:
            task.cancel()

    # --- removal ----------------------------------------------------------------------------

    def _remove(self, worker: Worker) -> None:
        """Out of every pool here at once; forgotten when its requests here have ended. A
        conversion this replica runs on it ends first (it fails when the worker is gone); a
        removal already running here (the admin API's) finishes on its own."""
        if worker.conversion_id in self.own_conversions or worker.state is WorkerState.REMOVING:
            return
        if worker.conversion_id is not None:
            self._stop_reporting(worker.conversion_id)
            self._registry.release_from_peer(
                worker, worker.conversion_id, WorkerState.ACTIVE, role=worker.role,
                bootstrap_port=None, epoch=worker.epoch,
            )  # fmt: skip
        self._registry.begin_removal(worker)
        self._spawn(self._forget_when_idle(worker))

    async def _forget_when_idle(self, worker: Worker) -> None:
        try:
            await asyncio.wait_for(worker.wait_until_no_inflight(), self._removal_timeout)
        except TimeoutError:
            log.warning("worker %s left the cluster with requests still in flight", worker.url)
        if self._registry.registered(worker) and worker.state is WorkerState.REMOVING:
            self._registry.forget(worker)
            log.info("worker %s left the cluster", worker.url)

    # --- lookups ----------------------------------------------------------------------------

    def _lookup(self, url: str) -> Worker | None:
        try:
            return self._registry.get(url)
        except UnknownWorker:
            return None
