"""Bring a replica's registry in line with the cluster's shared worker records.

Each record says a worker's pool, state, epoch and which conversion holds it. Applying one:
a worker not known here is added (unhealthy until this replica's own probe passes); a worker a
peer's conversion holds is held here too (out of selection), and once this replica has no
request left in flight on it, it reports so; the end of that conversion moves the worker to its
new pool; a worker being removed (its record says so: an operator's removal, a worker shutting
down) leaves this replica's pools once its in-flight requests here ended. A worker this
replica's own conversion holds is left to that conversion, which publishes its outcome itself.

A record that goes without saying so (the worker's lease expired: etcd stalled longer than the
lease, or the worker lost etcd for a while) is registration churn, not a removal: a worker that
this replica reaches and that serves keeps serving for a grace period (``grace_secs``, at least
the lease TTL and a re-registration), during which its record usually comes back. It leaves
when its probes or its circuit say it does not serve, or when the grace period ends; the last
healthy worker of a pool stays as long as it is (a pool never goes empty because of records
alone). A record put again takes the worker back, also while its removal waits for in-flight
requests (the same worker: nothing drains; another role: the record's role and epoch apply).
Why a worker left, or stays without a record, is logged and shown in ``GET /cluster``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pd_protocol.cluster import WorkerRecord
from pd_router.control.circuit import CircuitState
from pd_router.control.cluster.view import ClusterView
from pd_router.control.workers import (
    CONVERTING,
    RegistryError,
    Role,
    Unavailability,
    UnknownWorker,
    Worker,
    WorkerRegistry,
    WorkerState,
)

log = logging.getLogger("pd_router.cluster")

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]
# How many departures of workers whose record went ``GET /cluster`` keeps.
DEPARTURES_KEPT = 20


@dataclass
class Unregistered:
    """A worker serving here while the cluster holds no record of it."""

    since: float
    timer: asyncio.TimerHandle | None = None
    # Why it stays past its grace period (the last healthy worker of its pool), if it does.
    kept: str | None = None


class Mirror:
    def __init__(
        self,
        registry: WorkerRegistry,
        view: ClusterView,
        replica_id: str,
        *,
        probe: Callable[[Worker], Coroutine[Any, Any, Any]],
        report_drained: Callable[[str], Awaitable[None]],
        spawn: Spawn,
        removal_timeout_secs: float,
        grace_secs: float,
    ) -> None:
        self._registry = registry
        self._view = view
        self._replica_id = replica_id
        self._probe = probe
        self._report_drained = report_drained
        self._spawn = spawn
        self._removal_timeout = removal_timeout_secs
        self._grace = grace_secs
        # Conversions this replica runs: their workers follow the conversion, not the record.
        self.own_conversions: set[str] = set()
        self._reporting: dict[str, asyncio.Task] = {}
        self._unregistered: dict[str, Unregistered] = {}
        # Workers leaving because their record went (a record put again takes them back).
        self._unrecorded_removals: set[str] = set()
        self._departures: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=DEPARTURES_KEPT
        )
        registry.on_unavailable(self._on_unavailable)

    def sync_all(self) -> None:
        """After a full read: every record applied, every worker without one unregistered."""
        for url in list(self._view.records):
            self.changed(url)
        for worker in self._registry:
            if worker.url not in self._view.records:
                self._record_gone(worker)

    def stop(self) -> None:
        """No grace period ends any more (the replica is leaving)."""
        for url in list(self._unregistered):
            self._forget_unregistered(url)

    def changed(self, url: str) -> None:
        stored = self._view.records.get(url)
        worker = self._lookup(url)
        if worker is None:
            # Forgotten here already (removed through this replica's API before its own
            # record's echo came): nothing of it waits for a record any more.
            self._forget_unregistered(url)
        try:
            if stored is None:
                if worker is not None:
                    self._record_gone(worker)
            else:
                self._apply(self._registered_again(worker, stored.record), stored.record)
        except RegistryError as exc:
            log.warning("cluster record of %s not applied here: %s", url, exc)

    def as_dict(self) -> dict[str, Any]:
        """The workers serving without a record and the last ones that left for lack of one."""
        now = time.monotonic()
        return {
            "unregistered": {
                url: {"for_secs": round(now - entry.since, 1), "kept": entry.kept}
                for url, entry in sorted(self._unregistered.items())
            },
            "departed": list(self._departures),
        }

    @property
    def unregistered_count(self) -> int:
        return len(self._unregistered)

    def without_record(self, url: str) -> bool:
        """Whether the worker at ``url`` (the registry's spelling) serves here while the
        cluster has no record of it."""
        return url in self._unregistered

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

    # --- records that go and come back ------------------------------------------------------

    def _record_gone(self, worker: Worker) -> None:
        """The worker's record went without a removal: a grace period while it serves. A
        worker this replica's conversion holds is left to it (its end applies the record)."""
        if (
            worker.state is WorkerState.REMOVING
            or worker.conversion_id in self.own_conversions
            or worker.url in self._unregistered
        ):
            return
        unserving = self._not_serving(worker)
        if unserving is not None:
            self._leave(worker, f"its record went and it is {unserving} here")
            return
        entry = Unregistered(since=time.monotonic())
        self._unregistered[worker.url] = entry
        self._arm(worker.url, entry)
        log.warning(
            "worker %s has no record in the cluster any more (its lease expired?): it keeps "
            "serving here for up to %gs while it registers again",
            worker.url, self._grace,
        )  # fmt: skip

    def _registered_again(self, worker: Worker | None, record: WorkerRecord) -> Worker | None:
        """A record for the worker is there: it is registered; a removal that its record's
        going began is called off (nothing drained meanwhile stops)."""
        if worker is None or record.state == WorkerState.REMOVING:
            return worker
        entry = self._forget_unregistered(worker.url)
        if entry is not None:
            log.info(
                "worker %s registered again after %.1fs without a record",
                worker.url, time.monotonic() - entry.since,
            )  # fmt: skip
        if worker.url in self._unrecorded_removals and worker.state is WorkerState.REMOVING:
            self._unrecorded_removals.discard(worker.url)
            self._registry.readmit(worker)
            log.warning("worker %s is back in the cluster: taken back while leaving", worker.url)
        return worker

    def _arm(self, url: str, entry: Unregistered) -> None:
        entry.timer = asyncio.get_running_loop().call_later(self._grace, self._grace_over, url)

    def _forget_unregistered(self, url: str) -> Unregistered | None:
        entry = self._unregistered.pop(url, None)
        if entry is not None and entry.timer is not None:
            entry.timer.cancel()
        return entry

    def _grace_over(self, url: str) -> None:
        """The grace period ended without a record: the worker leaves, unless it is the last
        healthy one of its pool (then it stays, and is looked at again a period later)."""
        entry = self._unregistered.get(url)
        worker = self._lookup(url)
        if entry is None:
            return
        if worker is None or worker.state is WorkerState.REMOVING:
            self._forget_unregistered(url)
            return
        unserving = self._not_serving(worker)
        if unserving is not None:
            self._leave(worker, f"no record for {self._grace:g}s and it is {unserving} here")
            return
        if self._registry.active_healthy_count(worker.role, excluding=worker) == 0:
            if entry.kept is None:
                log.warning(
                    "worker %s has had no record for %gs; kept: the last healthy %s worker",
                    url, self._grace, worker.role.value,
                )  # fmt: skip
            entry.kept = f"the last healthy {worker.role.value} worker"
            self._arm(url, entry)
            return
        self._leave(worker, f"no record in the cluster for {self._grace:g}s")

    def _on_unavailable(self, worker: Worker, why: Unavailability) -> None:
        """A probe found a worker without a record unhealthy: it leaves now (after the
        registry's own change, outside of it)."""
        if why is Unavailability.UNHEALTHY and worker.url in self._unregistered:
            asyncio.get_running_loop().call_soon(self._leave_if_unserving, worker)

    def _leave_if_unserving(self, worker: Worker) -> None:
        if (
            worker.url in self._unregistered
            and self._registry.registered(worker)
            and worker.state is not WorkerState.REMOVING
            and self._not_serving(worker) is not None
        ):
            self._leave(worker, "it has no record and its probe failed")

    @staticmethod
    def _not_serving(worker: Worker) -> str | None:
        """Why this replica's probes, circuit or a conversion say the worker does not serve
        (None: it serves)."""
        if worker.state is WorkerState.FAILED:
            return "failed"
        if not worker.healthy:
            return "unhealthy"
        if worker.circuit.state is CircuitState.OPEN:
            return "behind an open circuit"
        return None

    def _leave(self, worker: Worker, reason: str) -> None:
        """Out of the pools because its record went: said in the log (a warning when its
        pool has no healthy worker left) and in ``GET /cluster``."""
        self._forget_unregistered(worker.url)
        role = worker.role
        empties = (
            worker.state is WorkerState.ACTIVE
            and self._registry.active_healthy_count(role, excluding=worker) == 0
        )
        self._departures.append(
            {"url": worker.url, "role": role.value, "reason": reason, "at": time.time()}
        )
        if empties:
            log.warning(
                "worker %s leaves: %s; no healthy %s worker is left", worker.url, reason, role.value
            )
        else:
            log.info("worker %s leaves: %s", worker.url, reason)
        if self._remove(worker):
            self._unrecorded_removals.add(worker.url)

    # --- removal ----------------------------------------------------------------------------

    def _remove(self, worker: Worker) -> bool:
        """Out of every pool here at once; forgotten when its requests here have ended. A
        conversion this replica runs on it ends first (it fails when the worker is gone); a
        removal already running here (the admin API's) finishes on its own. Whether this
        began a removal."""
        self._forget_unregistered(worker.url)
        if worker.conversion_id in self.own_conversions or worker.state is WorkerState.REMOVING:
            return False
        if worker.conversion_id is not None:
            self._stop_reporting(worker.conversion_id)
            self._registry.release_from_peer(
                worker, worker.conversion_id, WorkerState.ACTIVE, role=worker.role,
                bootstrap_port=None, epoch=worker.epoch,
            )  # fmt: skip
        self._registry.begin_removal(worker)
        self._spawn(self._forget_when_idle(worker))
        return True

    async def _forget_when_idle(self, worker: Worker) -> None:
        try:
            await asyncio.wait_for(worker.wait_until_no_inflight(), self._removal_timeout)
        except TimeoutError:
            log.warning("worker %s left the cluster with requests still in flight", worker.url)
        if self._registry.registered(worker) and worker.state is WorkerState.REMOVING:
            self._unrecorded_removals.discard(worker.url)
            self._registry.forget(worker)
            log.info("worker %s left the cluster", worker.url)

    # --- lookups ----------------------------------------------------------------------------

    def _lookup(self, url: str) -> Worker | None:
        try:
            return self._registry.get(url)
        except UnknownWorker:
            return None
