"""``least_load`` and the load reports it routes by: the policy's choice on a data plane's own
members (a snapshot and the reports applied as the control side pushes them), how a
``/v1/loads`` answer becomes a report, the poll interval, the reports on the wire and from the
publisher to its data planes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from pd_router.circuit_state import CircuitState
from pd_router.control.load_poller import MAX_INTERVAL_SECS, MIN_INTERVAL_SECS, next_interval
from pd_router.control.load_report import BadLoadReport, LoadReport, parse_loads
from pd_router.dataplane.routing.policies import (
    POLICY_ALIASES,
    LeastLoadPolicy,
    alias_warning,
    make_policy,
)
from pd_router.dataplane.routing.snapshot import Member, SnapshotPools
from pd_router.roles import Role
from pd_router.wire import Snapshot, WireError, WorkerEntry, WorkerLoads, decode, encode
from tests.unit.test_publisher import Control, settle
from tests.unit.test_wire import pools as plain_pools

A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"


def entry(url: str) -> WorkerEntry:
    return WorkerEntry(url, Role.DECODE, "", 0, None, True, True, CircuitState.CLOSED, None, None)


def pools(*urls: str) -> SnapshotPools:
    """A data plane's pools with ``urls`` as pickable decodes, picked by ``least_load``."""
    routing = plain_pools()
    routing.policies[Role.DECODE] = LeastLoadPolicy(random.Random(5))
    routing.apply(Snapshot(1, tuple(entry(url) for url in urls)))
    return routing


def members(pools: SnapshotPools, *urls: str) -> list[Member]:
    found = [pools.member(url) for url in urls]
    assert all(m is not None for m in found)
    return found  # type: ignore[return-value]


def picks(pools: SnapshotPools, count: int) -> list[str]:
    """``count`` picks of a decode, each held in flight (as the request path does)."""
    chosen = []
    for _ in range(count):
        member = pools.pick(Role.DECODE)
        pools.acquire(member)
        chosen.append(member.url)
    return chosen


# --- the policy --------------------------------------------------------------------------


def test_least_load_is_a_policy_of_its_own_not_an_alias():
    assert make_policy("least_load").name == "least_load"
    assert "least_load" not in POLICY_ALIASES
    assert alias_warning("least_load") is None


def test_the_worker_reporting_the_fewest_requests_is_picked_whatever_the_in_flight_counts():
    plane = pools(A, B)
    a, b = members(plane, A, B)
    a.inflight, b.inflight = 0, 3
    plane.apply_loads(WorkerLoads({A: (20, 1.0), B: (4, 1.0)}))
    assert plane.pick(Role.DECODE).url == B


def test_requests_sent_since_the_report_count_so_a_burst_spreads():
    plane = pools(A, B)
    plane.apply_loads(WorkerLoads({A: (5, 1.0), B: (2, 1.0)}))
    chosen = picks(plane, 7)
    # B (2) takes three to reach A's 5; then they alternate.
    assert chosen[:3] == [B, B, B]
    assert sorted(chosen[3:]) == [A, A, B, B]


def test_a_new_report_replaces_what_was_counted_since_the_last():
    plane = pools(A, B)
    plane.apply_loads(WorkerLoads({A: (3, 1.0), B: (0, 1.0)}))
    assert picks(plane, 3) == [B, B, B]
    # B's new report says its queue drained; A's still says 3.
    plane.apply_loads(WorkerLoads({A: (3, 1.0), B: (0, 2.0)}))
    assert picks(plane, 3) == [B, B, B]


def test_a_worker_without_a_report_is_judged_by_its_in_flight_count():
    plane = pools(A, B)
    (b,) = members(plane, B)
    b.inflight = 2
    plane.apply_loads(WorkerLoads({A: (4, 1.0)}))
    assert plane.pick(Role.DECODE).url == B
    b.inflight = 5
    assert plane.pick(Role.DECODE).url == A


def test_equal_reports_go_to_the_worker_with_fewer_in_flight():
    plane = pools(A, B, C)
    a, b, c = members(plane, A, B, C)
    a.inflight, b.inflight, c.inflight = 2, 1, 2
    plane.apply_loads(WorkerLoads({A: (3, 1.0), B: (3, 1.0), C: (3, 1.0)}))
    assert plane.pick(Role.DECODE).url == B


def test_full_ties_are_broken_at_random():
    plane = pools(A, B, C)
    plane.apply_loads(WorkerLoads({A: (1, 1.0), B: (1, 1.0), C: (1, 1.0)}))
    assert {plane.pick(Role.DECODE).url for _ in range(60)} == {A, B, C}


def test_a_member_that_joins_after_the_reports_gets_its_own():
    plane = pools(A)
    plane.apply_loads(WorkerLoads({A: (1, 1.0), B: (9, 1.0)}))
    plane.apply(Snapshot(2, (entry(A), entry(B))))
    (b,) = members(plane, B)
    assert (b.load, b.load_at) == (9, 1.0)


def test_a_worker_left_out_of_the_reports_has_none():
    plane = pools(A, B)
    plane.apply_loads(WorkerLoads({A: (1, 1.0), B: (9, 1.0)}))
    plane.apply_loads(WorkerLoads({A: (1, 1.0)}))
    (b,) = members(plane, B)
    assert b.load is None


# --- /v1/loads ---------------------------------------------------------------------------

# SGLang 0.5.23's answer to GET /v1/loads?include=core for a server of two DP ranks.
TWO_RANKS = {
    "timestamp": "2026-12-05T10:00:00+00:00",
    "version": "0.5.23",
    "accelerator": None,
    "num_accelerators": 1,
    "loads": [
        {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 5, "token_usage": 0.25},
        {"dp_rank": 1, "num_running_reqs": 2, "num_waiting_reqs": 0, "token_usage": 0.5},
    ],
}


def test_a_report_sums_running_and_waiting_over_the_dp_ranks():
    report = parse_loads(TWO_RANKS, 7.0)
    assert report == LoadReport(running=5, waiting=5, token_usage=0.5, ranks=2, read_at=7.0)
    assert report.requests == 10


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"loads": []},
        {"loads": [{"num_running_reqs": "3", "num_waiting_reqs": 0}]},
        {"loads": [{"num_running_reqs": 1}]},
        {"loads": [{"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": "high"}]},
    ],
)
def test_an_answer_not_shaped_as_sglang_s_is_no_report(body: Any):
    with pytest.raises(BadLoadReport):
        parse_loads(body, 0.0)


def test_the_poll_interval_tightens_when_loads_move_and_backs_off_when_steady():
    assert next_interval(MAX_INTERVAL_SECS, moved=True) == MIN_INTERVAL_SECS
    waits = [MIN_INTERVAL_SECS]
    while waits[-1] < MAX_INTERVAL_SECS:
        waits.append(next_interval(waits[-1], moved=False))
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0]
    assert next_interval(MAX_INTERVAL_SECS, moved=False) == MAX_INTERVAL_SECS


# --- the wire and the publisher ----------------------------------------------------------


def test_worker_loads_travel_as_they_were_sent():
    message = WorkerLoads({A: (12, 1234.5), B: (0, 7)})
    assert decode(encode(message)) == message


@pytest.mark.parametrize("loads", [{A: [1]}, {A: ["1", 2.0]}, {A: [1, None]}, [A, 1, 2.0]])
def test_worker_loads_of_another_shape_are_refused(loads: Any):
    with pytest.raises(WireError):
        decode(orjson.dumps(["loads", {"loads": loads}]))


@pytest.fixture
async def control() -> AsyncIterator[Control]:
    control = Control()
    yield control
    await control.planes.stop()


async def test_a_changed_report_reaches_every_data_plane(control):
    planes = [await control.attach(0), await control.attach(1)]
    report = LoadReport(running=2, waiting=7, token_usage=0.1, ranks=1, read_at=3.0)
    control.registry.set_load_report(control.decode, report)
    await asyncio.sleep(0.1)
    for plane in planes:
        loads = [m for m in plane.drain() if isinstance(m, WorkerLoads)]
        assert loads[-1] == WorkerLoads({control.decode.url: (9, 3.0)})


async def test_a_data_plane_that_attaches_gets_the_reports_after_its_snapshot(control):
    report = LoadReport(running=1, waiting=0, token_usage=0.0, ranks=1, read_at=3.0)
    control.registry.set_load_report(control.prefill, report)
    plane = await control.attach(0)
    await settle()
    _, snapshot, loads = plane.drain()[:3]
    assert isinstance(snapshot, Snapshot)
    assert loads == WorkerLoads({control.prefill.url: (1, 3.0)})


async def test_no_reports_no_load_messages(control):
    plane = await control.attach(0)
    await asyncio.sleep(0.1)
    assert not [m for m in plane.drain() if isinstance(m, WorkerLoads)]
