"""The control side of the data planes (pd_router/control/publisher.py), through its public
methods only: each data plane is the other end of an in-process channel that the test plays,
and what its reports change in the registry is read there (in-flight counts, the picks a data
plane may still make, circuits)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pd_router.config import HealthConfig
from pd_router.control.health import HealthMonitor
from pd_router.control.latency import LatencyRecorder
from pd_router.control.publisher import DataPlanes
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.dataplane.link.channel import LocalChannel
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from pd_router.wire import PROTOCOL_VERSION, ChannelClosed, Hello, Report, Snapshot, StuckPair

URL = "http://10.0.0.1:30000"
OTHER = "http://10.0.0.2:30000"


async def settle() -> None:
    """A few steps of the loop: the control side's readers take what was sent (no timer)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Plane:
    """The data-plane end of one channel, collecting what the control side sends."""

    def __init__(self, channel: LocalChannel) -> None:
        self.channel = channel
        self.received: list[object] = []
        self._read = 0
        self._reader = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        with contextlib.suppress(ChannelClosed):
            while True:
                self.received.append(await self.channel.receive())

    def drain(self) -> list[object]:
        """What the control side sent since the last call."""
        out = self.received[self._read :]
        self._read = len(self.received)
        return out

    async def snapshots(self) -> list[Snapshot]:
        await settle()
        return [m for m in self.drain() if isinstance(m, Snapshot)]

    async def report(
        self,
        version: int,
        inflight: dict[str, int] | None = None,
        *,
        idle_at: dict[str, float] | None = None,
        outcomes: tuple[tuple[str, bool, int], ...] = (),
        connections: int = 0,
    ) -> None:
        self.channel.send(
            Report(version, inflight or {}, idle_at or {}, outcomes, (), (), {}, connections)
        )
        await settle()


class Control:
    """A registry with a prefill and a decode, and the publisher that feeds data planes."""

    def __init__(self) -> None:
        self.registry = WorkerRegistry(RouterMetrics())
        health = HealthMonitor(self.registry, HealthConfig(enabled=False))
        # (decode, prefill) of every forget asked for, in order.
        self.forgotten: list[tuple[str, str]] = []
        self.planes = DataPlanes(self.registry, health, LatencyRecorder(), self.forget)
        self.prefill = self.registry.add(URL, Role.PREFILL, 8998)
        self.decode = self.registry.add(OTHER, Role.DECODE)

    async def forget(self, decode: Worker, prefill: Worker) -> None:
        self.forgotten.append((decode.url, prefill.url))

    async def attach(self, index: int) -> Plane:
        ours, theirs = LocalChannel.pair()
        self.planes.attach(index, ours)
        theirs.send(Hello(PROTOCOL_VERSION))
        await settle()
        return Plane(theirs)


@pytest.fixture
async def control() -> AsyncIterator[Control]:
    control = Control()
    yield control
    await control.planes.stop()


async def test_a_data_plane_gets_the_hello_and_the_current_snapshot_first(control):
    plane = await control.attach(0)
    await settle()
    hello, snapshot = plane.drain()[:2]
    assert hello == Hello(PROTOCOL_VERSION)
    assert isinstance(snapshot, Snapshot)
    assert snapshot.version == control.planes.version


async def test_every_registry_change_sends_a_new_version_to_every_data_plane(control):
    planes = [await control.attach(0), await control.attach(1)]
    await settle()
    for plane in planes:
        plane.drain()
    control.registry.set_health(control.prefill, False)
    for plane in planes:
        (snapshot,) = await plane.snapshots()
        assert snapshot.version == control.planes.version
        entry = next(w for w in snapshot.workers if w.url == URL)
        assert not entry.pickable


async def test_the_in_flight_count_is_the_sum_of_the_data_planes_reports(control):
    a, b = await control.attach(0), await control.attach(1)
    version = control.planes.version
    await a.report(version, {URL: 2})
    await b.report(version, {URL: 3})
    assert control.prefill.inflight == 5
    await a.report(version, {})
    assert control.prefill.inflight == 3


async def test_a_worker_is_idle_once_every_report_says_so_with_the_latest_idle_time(control):
    a, b = await control.attach(0), await control.attach(1)
    version = control.planes.version
    await a.report(version, {URL: 1})
    await b.report(version, {}, idle_at={URL: 40.0})
    assert control.prefill.inflight == 1
    await a.report(version, {}, idle_at={URL: 50.0})
    assert (control.prefill.inflight, control.prefill.idle_at) == (0, 50.0)
    await asyncio.wait_for(control.prefill.wait_until_no_inflight(), 1.0)


async def test_a_data_plane_that_has_not_acked_a_worker_leaving_selection_may_still_pick_it(
    control,
):
    a, b = await control.attach(0), await control.attach(1)
    control.registry.set_admitting(control.prefill, False)
    left_at = control.planes.version
    assert control.prefill.picked_elsewhere
    assert control.prefill.inflight == 2
    await a.report(left_at)
    assert control.prefill.inflight == 1 and control.prefill.picked_elsewhere
    await b.report(left_at)
    assert control.prefill.inflight == 0 and not control.prefill.picked_elsewhere
    await asyncio.wait_for(control.prefill.wait_until_unpicked(), 1.0)


async def test_an_older_ack_does_not_undo_a_newer_one(control):
    plane = await control.attach(0)
    control.registry.set_admitting(control.prefill, False)
    left_at = control.planes.version
    await plane.report(left_at)
    await plane.report(left_at - 1)
    assert not control.prefill.picked_elsewhere


async def test_a_worker_back_in_selection_waits_for_no_ack(control):
    await control.attach(0)
    control.registry.set_admitting(control.prefill, False)
    control.registry.set_admitting(control.prefill, True)
    assert not control.prefill.picked_elsewhere and control.prefill.inflight == 0


async def test_a_data_plane_that_exits_takes_its_in_flight_share_with_it(control):
    a, b = await control.attach(0), await control.attach(1)
    version = control.planes.version
    await a.report(version, {URL: 2})
    await b.report(version, {URL: 1})
    control.planes.detach(0)
    assert control.prefill.inflight == 1
    assert a.channel.closed


async def test_a_data_plane_that_exits_is_not_waited_for_to_ack(control):
    a = await control.attach(0)
    await control.attach(1)
    control.registry.set_admitting(control.prefill, False)
    await a.report(control.planes.version)
    control.planes.detach(1)
    assert not control.prefill.picked_elsewhere and control.prefill.inflight == 0


async def test_failed_legs_in_the_reports_open_the_workers_circuit(control):
    plane = await control.attach(0)
    threshold = control.prefill.circuit.config.failure_threshold
    await plane.report(control.planes.version, outcomes=((URL, False, threshold),))
    assert not control.prefill.circuit.allows()
    snapshot = (await plane.snapshots())[-1]
    assert next(w for w in snapshot.workers if w.url == URL).circuit == "open"


async def test_a_successful_leg_starts_the_failure_count_over(control):
    plane = await control.attach(0)
    threshold = control.prefill.circuit.config.failure_threshold
    version = control.planes.version
    await plane.report(version, outcomes=((URL, False, threshold - 1), (URL, True, 1)))
    await plane.report(version, outcomes=((URL, False, 1),))
    assert control.prefill.circuit.allows()


async def test_reports_about_a_worker_the_registry_forgot_are_ignored(control):
    plane = await control.attach(0)
    await plane.report(control.planes.version, {"http://10.9.9.9:1": 4}, outcomes=(
        ("http://10.9.9.9:1", False, 10),
    ))  # fmt: skip
    assert [w.inflight for w in control.registry] == [0, 0]
    assert not plane.channel.closed


async def test_a_data_plane_of_another_protocol_version_is_refused(control):
    ours, theirs = LocalChannel.pair()
    control.planes.attach(0, ours)
    theirs.send(Hello(PROTOCOL_VERSION + 1))
    await settle()
    assert theirs.closed
    control.registry.set_admitting(control.prefill, False)
    assert not control.prefill.picked_elsewhere


async def test_a_data_plane_sending_what_is_not_for_the_control_side_is_refused(control):
    plane = await control.attach(0)
    plane.channel.send(Snapshot(1, ()))
    await settle()
    assert plane.channel.closed


async def test_a_forgotten_worker_leaves_the_snapshots(control):
    plane = await control.attach(0)
    await settle()
    plane.drain()
    control.registry.begin_removal(control.prefill)
    control.registry.forget(control.prefill)
    snapshot = (await plane.snapshots())[-1]
    assert [w.url for w in snapshot.workers] == [OTHER]


async def test_a_stuck_pair_makes_its_decode_forget_the_prefill(control):
    plane = await control.attach(0)
    plane.channel.send(StuckPair(URL, OTHER))
    await settle()
    assert control.forgotten == [(OTHER, URL)]


async def test_a_stuck_pair_whose_decode_is_no_decode_now_or_unknown_is_let_be(control):
    plane = await control.attach(0)
    plane.channel.send(StuckPair(URL, "http://10.0.0.9:30000"))
    plane.channel.send(StuckPair(OTHER, URL))
    await settle()
    assert control.forgotten == []
