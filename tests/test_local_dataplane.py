"""The data plane of a one-process router (``--workers 1``): it routes from the snapshots the
control side pushes over a channel with no socket (a LocalChannel pair), and reports back over
it. A drain waits for the data plane's last request on the worker, not for its next batch of
reports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pd_router.config import HealthConfig
from pd_router.control.circuit import CircuitConfig, CircuitState
from pd_router.control.health import HealthMonitor
from pd_router.control.latency import LatencyRecorder
from pd_router.control.publisher import DataPlanes
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.dataplane.link.channel import ChannelClosed, LocalChannel
from pd_router.dataplane.link.reports import Reports
from pd_router.dataplane.routing.policies import make_policy
from pd_router.dataplane.routing.snapshot import Member, SnapshotPools
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from pd_router.wire import PROTOCOL_VERSION, Hello, Snapshot, Suspect
from tests.router_helpers import generate_body, running_router, wait_until


async def forget_nothing(decode: Worker, prefill: Worker) -> None:
    """The publisher's ``forget``, for tests where no pair gets stuck."""


DECODE = "http://127.0.0.1:9"
# Longer than any test here waits: what a test sees came from a report sent at once.
SLOW_REPORTS_SECS = 60.0


async def test_a_local_channel_hands_each_message_over_in_order():
    one, other = LocalChannel.pair()
    one.send(Suspect("a"))
    one.send(Suspect("b"))
    other.send(Suspect("back"))
    assert [await other.receive(), await other.receive()] == [Suspect("a"), Suspect("b")]
    assert await one.receive() == Suspect("back")


async def test_a_closed_local_channel_delivers_what_was_sent_before_then_ends():
    one, other = LocalChannel.pair()
    waiting = asyncio.ensure_future(one.receive())
    other.send(Suspect("last"))
    other.close()
    assert await waiting == Suspect("last")
    assert one.closed
    with pytest.raises(ChannelClosed):
        await one.receive()
    one.send(Suspect("dropped"))
    with pytest.raises(ChannelClosed):
        await other.receive()


class LinkedPlane:
    """A registry and its publisher linked in memory to one data plane's pools, whose reports
    go out every :data:`SLOW_REPORTS_SECS` unless something asks for one at once."""

    def __init__(self) -> None:
        self.registry = WorkerRegistry(RouterMetrics(), CircuitConfig(failure_threshold=1))
        self.dataplanes = DataPlanes(
            self.registry,
            HealthMonitor(self.registry, HealthConfig()),
            LatencyRecorder(),
            forget_nothing,
        )
        self.control_end, self.plane_end = LocalChannel.pair()
        self.reports = Reports(self.plane_end, list, [], interval=SLOW_REPORTS_SECS)
        self.pools = SnapshotPools(
            {role: make_policy("round_robin") for role in Role},
            index=0,
            wake=self.reports.wake,
            suspect=self.reports.suspect,
            stuck=self.reports.stuck,
            on_unavailable=lambda url: None,
            count_refusal=self.reports.count_refusal,
        )

    async def follow(self) -> None:
        self.plane_end.send(Hello(PROTOCOL_VERSION))
        while True:
            message = await self.plane_end.receive()
            if isinstance(message, Snapshot):
                self.pools.apply(message)
                self.reports.send(self.pools, force=True)


@contextlib.asynccontextmanager
async def linked_plane() -> AsyncIterator[LinkedPlane]:
    plane = LinkedPlane()
    plane.registry.add(DECODE, Role.DECODE)
    plane.dataplanes.attach(0, plane.control_end)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(plane.follow()), loop.create_task(plane.reports.run(plane.pools))]
    try:
        await wait_until(lambda: plane.pools.version == plane.dataplanes.version, 1.0, "acked")
        yield plane
    finally:
        for task in tasks:
            task.cancel()
        await plane.dataplanes.stop()


def dispatched(plane: LinkedPlane) -> Member:
    member = plane.pools.pick(Role.DECODE)
    plane.pools.acquire(member)
    return member


async def wait_idle(worker: Worker) -> None:
    await asyncio.wait_for(worker.wait_until_no_inflight(), 1.0)


async def test_a_removal_ends_its_wait_when_the_data_planes_last_request_ends():
    async with linked_plane() as plane:
        member = dispatched(plane)
        plane.reports.wake()
        worker = plane.registry.get(DECODE)
        await wait_until(lambda: worker.inflight == 1, 1.0, "in flight reported")
        plane.registry.begin_removal(worker)
        await asyncio.wait_for(worker.wait_until_unpicked(), 1.0)
        plane.pools.release(member)
        await wait_idle(worker)
        assert worker.inflight == 0


async def test_a_failed_leg_reaches_the_workers_circuit_without_waiting_for_the_batch():
    async with linked_plane() as plane:
        member = dispatched(plane)
        member.circuit.record_failure()
        plane.pools.release(member)
        circuit = plane.registry.get(DECODE).circuit
        await wait_until(lambda: circuit.state is CircuitState.OPEN, 1.0, "circuit open")
        await wait_until(lambda: member.circuit.state is CircuitState.OPEN, 1.0, "routed by")


async def test_a_one_process_router_serves_from_its_data_planes_snapshot_and_counts_once(
    pd_cluster,
):
    async with running_router(pd_cluster) as router, router.client() as http:
        for n in range(3):
            response = await http.post("/generate", json=generate_body(f"counted {n}"))
            assert response.status_code == 200
        assert router.dataplane.pools.version == router.state.dataplanes.version
        text = (await http.get("/metrics")).text
    line = 'pd_router_requests_total{endpoint="/generate",status="200"} '
    assert [float(s.split()[-1]) for s in text.splitlines() if s.startswith(line)] == [3.0]
