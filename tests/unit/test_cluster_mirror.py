"""How a replica takes in its cluster's records, on recorded etcd events and a real registry
(no etcd, no processes): the view keeps what etcd said, the mirror moves workers between this
replica's pools, holds the ones a peer's conversion drains and reports them drained, keeps the
ones whose record went for a grace period (the last healthy one of a pool for good) and takes
them back when their record returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from pd_protocol.cluster import ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import EventType, KeyValue, WatchEvent
from pd_router.control.cluster.mirror import Mirror
from pd_router.control.cluster.view import ClusterView
from pd_router.control.workers import Role, Worker, WorkerRegistry, WorkerState
from pd_router.metrics import RouterMetrics

KEYS = ClusterKeys("test")
URL = "http://10.0.0.1:30000"
OTHER = "http://10.0.0.2:30000"
# How long a worker whose record went stays in its pool here (a replica: two lease TTLs).
GRACE_SECS = 0.2


class Replica:
    """A registry and its mirror, as one replica (``r2``) has them; probes pass at once."""

    def __init__(self) -> None:
        self.registry = WorkerRegistry(RouterMetrics())
        self.view = ClusterView(KEYS)
        self.reported: list[str] = []
        self.tasks: list[asyncio.Task] = []
        self.mirror = Mirror(
            self.registry,
            self.view,
            "r2",
            probe=self._probe,
            report_drained=self._report,
            spawn=self._spawn,
            removal_timeout_secs=5.0,
            grace_secs=GRACE_SECS,
        )
        self.revision = 0

    async def _probe(self, worker: Worker) -> None:
        self.registry.set_health(worker, True)

    async def _report(self, conversion: str) -> None:
        self.reported.append(conversion)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task

    async def put(self, record: WorkerRecord) -> None:
        self.revision += 1
        kv = KeyValue(KEYS.worker(record.url), record.encode(), 1, self.revision, 1, 0)
        self._apply(WatchEvent(EventType.PUT, kv))
        await self.settle()

    async def delete(self, key: str) -> None:
        self.revision += 1
        self._apply(WatchEvent(EventType.DELETE, KeyValue(key, b"", 0, self.revision, 0, 0)))
        await self.settle()

    def _apply(self, event: WatchEvent) -> None:
        url = self.view.apply(event)
        if url is not None:
            self.mirror.changed(url)

    async def settle(self) -> None:
        await asyncio.sleep(0)
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=1.0)

    def worker(self) -> Worker:
        return self.registry.get(URL)

    def departures(self) -> dict[str, str]:
        """{url: why it left} of the workers that left for lack of a record."""
        return {d["url"]: d["reason"] for d in self.mirror.as_dict()["departed"]}


def record(url: str = URL, **fields: Any) -> WorkerRecord:
    return WorkerRecord(url, **{"role": "prefill", "bootstrap_port": 8998, **fields})


@pytest.fixture
def replica() -> Replica:
    return Replica()


async def test_a_worker_first_seen_in_a_record_joins_its_pool_once_probed(replica):
    await replica.put(record())
    worker = replica.worker()
    assert (worker.role, worker.bootstrap_port, worker.state) == (
        Role.PREFILL, 8998, WorkerState.ACTIVE,
    )  # fmt: skip
    assert replica.registry.selectable(Role.PREFILL) == [worker]


async def test_a_peers_conversion_takes_the_worker_out_of_selection_and_it_is_reported(replica):
    await replica.put(record())
    await replica.put(record(state="draining", conversion="r1-c1", owner="r1", to_role="decode"))
    worker = replica.worker()
    assert (worker.state, worker.conversion_id) == (WorkerState.DRAINING, "r1-c1")
    assert replica.registry.selectable(Role.PREFILL) == []
    assert replica.reported == ["r1-c1"]


async def test_the_drain_report_waits_for_this_replicas_requests_on_the_worker(replica):
    await replica.put(record())
    worker = replica.worker()
    replica.registry.set_inflight(worker, 1, time.monotonic())
    replica.revision += 1
    held = record(state="draining", conversion="r1-c1", owner="r1", to_role="decode")
    replica._apply(WatchEvent(EventType.PUT, KeyValue(KEYS.worker(URL), held.encode(), 1, 9, 2, 0)))
    await asyncio.sleep(0)  # one step: the report's task runs to its wait for the request
    assert replica.reported == []
    assert not all(task.done() for task in replica.tasks)
    replica.registry.set_inflight(worker, 0, time.monotonic())
    await replica.settle()
    assert replica.reported == ["r1-c1"]


async def test_the_end_of_a_peers_conversion_moves_the_worker_to_its_new_pool(replica):
    await replica.put(record())
    await replica.put(record(state="draining", conversion="r1-c1", owner="r1", to_role="decode"))
    await replica.put(record(state="switching", conversion="r1-c1", owner="r1", to_role="decode"))
    await replica.put(record(role="decode", bootstrap_port=None, epoch=1))
    worker = replica.worker()
    assert (worker.role, worker.state, worker.epoch, worker.conversion_id) == (
        Role.DECODE, WorkerState.ACTIVE, 1, None,
    )  # fmt: skip
    assert replica.registry.selectable(Role.DECODE) == [worker]


async def test_a_worker_whose_record_went_serves_through_its_grace_period_then_leaves(replica):
    await replica.put(record())
    await replica.put(record(url=OTHER))
    await replica.delete(KEYS.worker(URL))
    worker = replica.worker()
    assert worker in replica.registry.selectable(Role.PREFILL)
    assert list(replica.mirror.as_dict()["unregistered"]) == [URL]
    await asyncio.sleep(GRACE_SECS * 1.5)
    await replica.settle()
    assert [w.url for w in replica.registry] == [OTHER]
    assert replica.departures() == {URL: f"no record in the cluster for {GRACE_SECS:g}s"}


async def test_an_unhealthy_worker_whose_record_went_leaves_at_once(replica):
    await replica.put(record())
    await replica.put(record(url=OTHER))
    replica.registry.set_health(replica.worker(), False)
    await replica.delete(KEYS.worker(URL))
    assert [w.url for w in replica.registry] == [OTHER]
    assert "unhealthy" in replica.departures()[URL]


async def test_a_worker_behind_an_open_circuit_whose_record_went_leaves_at_once(replica):
    await replica.put(record())
    await replica.put(record(url=OTHER))
    circuit = replica.worker().circuit
    for _ in range(circuit.config.failure_threshold):
        circuit.record_failure()
    await replica.delete(KEYS.worker(URL))
    assert [w.url for w in replica.registry] == [OTHER]
    assert "open circuit" in replica.departures()[URL]


async def test_a_failed_probe_ends_the_grace_period_at_once(replica):
    await replica.put(record())
    await replica.put(record(url=OTHER))
    await replica.delete(KEYS.worker(URL))
    replica.registry.set_health(replica.worker(), False)
    await replica.settle()
    assert [w.url for w in replica.registry] == [OTHER]
    assert "probe failed" in replica.departures()[URL]


async def test_the_last_healthy_worker_of_a_pool_stays_without_a_record(replica):
    await replica.put(record())
    await replica.put(record(url=OTHER))
    replica.registry.set_health(replica.registry.get(OTHER), False)
    await replica.delete(KEYS.worker(URL))
    await asyncio.sleep(GRACE_SECS * 2.5)
    assert replica.registry.selectable(Role.PREFILL) == [replica.worker()]
    kept = replica.mirror.as_dict()["unregistered"][URL]["kept"]
    assert kept == "the last healthy prefill worker"


async def test_a_record_put_again_within_the_grace_period_changes_nothing(replica):
    await replica.put(record(epoch=2))
    await replica.delete(KEYS.worker(URL))
    await replica.put(record(epoch=2))
    await asyncio.sleep(GRACE_SECS * 1.5)
    worker = replica.worker()
    assert (worker.state, worker.epoch) == (WorkerState.ACTIVE, 2)
    assert replica.mirror.as_dict() == {"unregistered": {}, "departed": []}


async def test_a_record_put_again_takes_back_a_worker_leaving_with_requests_in_flight(replica):
    await replica.put(record())
    await replica.put(record(url=OTHER))
    worker = replica.worker()
    replica.registry.set_inflight(worker, 1, time.monotonic())
    await replica.delete(KEYS.worker(URL))
    await asyncio.sleep(GRACE_SECS * 1.5)
    assert worker.state is WorkerState.REMOVING
    await replica.put(record())
    assert worker.state is WorkerState.ACTIVE
    replica.registry.set_inflight(worker, 0, time.monotonic())
    await replica.settle()
    assert replica.registry.selectable(Role.PREFILL) == [worker, replica.registry.get(OTHER)]


async def test_a_record_put_again_in_another_role_moves_the_worker_there(replica):
    await replica.put(record())
    await replica.delete(KEYS.worker(URL))
    await replica.put(record(role="decode", bootstrap_port=None))
    worker = replica.worker()
    assert (worker.role, worker.state) == (Role.DECODE, WorkerState.ACTIVE)
    assert replica.mirror.as_dict()["unregistered"] == {}


async def test_a_record_marked_removing_takes_the_worker_out_at_once(replica):
    """A worker that stops says so before its record goes: no grace period."""
    await replica.put(record())
    await replica.put(record(state="removing"))
    assert len(replica.registry) == 0


async def test_a_full_read_without_a_workers_record_starts_its_grace_period(replica):
    await replica.put(record())
    replica.view.reset([], replica.revision + 1)
    replica.mirror.sync_all()
    assert replica.worker().state is WorkerState.ACTIVE
    assert list(replica.mirror.as_dict()["unregistered"]) == [URL]


async def test_a_conversion_this_replica_runs_is_left_to_it(replica):
    await replica.put(record())
    worker = replica.worker()
    replica.registry.claim_for_conversion(worker, "r2-c1", lambda: None)
    replica.mirror.own_conversions.add("r2-c1")
    await replica.put(record(role="decode", bootstrap_port=None, epoch=1))
    assert (worker.role, worker.state, worker.conversion_id) == (
        Role.PREFILL, WorkerState.DRAINING, "r2-c1",
    )  # fmt: skip


async def test_a_role_another_replica_found_is_taken_over_with_its_epoch(replica):
    await replica.put(record())
    await replica.put(record(role="decode", bootstrap_port=None, epoch=3))
    worker = replica.worker()
    assert (worker.role, worker.epoch) == (Role.DECODE, 3)


def test_the_view_keeps_replicas_locks_reports_and_the_leader():
    view = ClusterView(KEYS)
    kvs = [
        KeyValue(KEYS.replica("r1"), b"{}", 1, 1, 1, 7),
        KeyValue(KEYS.replica("r2"), b"{}", 2, 2, 1, 8),
        KeyValue(KEYS.lock(URL), b"{}", 3, 3, 1, 7),
        KeyValue(KEYS.drain_report("r1-c1", "r2"), b"", 4, 4, 1, 8),
        KeyValue(KEYS.leader, b"r1", 5, 5, 1, 7),
    ]
    view.reset(kvs, 5)
    assert (view.replicas, set(view.locks), view.drained, view.leader) == (
        {"r1", "r2"}, {URL}, {"r1-c1": {"r2"}}, "r1",
    )  # fmt: skip
    view.apply(WatchEvent(EventType.DELETE, KeyValue(KEYS.replica("r1"), b"", 0, 6, 0, 0)))
    view.apply(WatchEvent(EventType.DELETE, KeyValue(KEYS.leader, b"", 0, 6, 0, 0)))
    assert (view.replicas, view.leader, view.revision) == ({"r2"}, None, 6)


def test_a_value_that_is_not_a_worker_record_is_ignored():
    view = ClusterView(KEYS)
    view.reset([KeyValue(KEYS.worker(URL), b"not json", 1, 1, 1, 0)], 1)
    assert view.records == {}


async def test_a_wait_for_a_change_started_before_the_change_is_woken_by_it():
    view = ClusterView(KEYS)
    waiter = asyncio.ensure_future(view.changed())
    view.apply(WatchEvent(EventType.PUT, KeyValue(KEYS.leader, b"r1", 1, 1, 1, 0)))
    await asyncio.wait_for(waiter, 1.0)
