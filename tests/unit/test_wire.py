"""The control/data-plane wire (pd_router.wire): every message survives the socket encoding as
the same typed record; bytes that are not a message of this protocol version are refused; a
hello of another version is told apart; a snapshot is applied only when consistent, and the
pools route on from the last one otherwise."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from pd_router.circuit_state import CircuitState
from pd_router.dataplane.routing.policies import make_policy
from pd_router.dataplane.routing.snapshot import SnapshotPools
from pd_router.roles import Role
from pd_router.wire import (
    NO_SNAPSHOT,
    PROTOCOL_VERSION,
    Hello,
    InconsistentSnapshot,
    InflightTotals,
    Message,
    MetricsAnswer,
    MetricsAsk,
    Report,
    Snapshot,
    SnapshotRefused,
    StuckPair,
    Suspect,
    VersionMismatch,
    WireError,
    WorkerEntry,
    check_consistent,
    check_hello,
    decode,
    encode,
)

PREFILL = "http://127.0.0.1:30001"
DECODE = "http://[::1]:30002"


def entry(url: str = PREFILL, **changes: object) -> WorkerEntry:
    """A pickable prefill with a closed circuit, with ``changes``."""
    base = WorkerEntry(
        PREFILL, Role.PREFILL, "m", 3, 8998, True, True, CircuitState.CLOSED, None, None
    )
    return dataclasses.replace(base, url=url, **changes)


MESSAGES: list[Message] = [
    Hello(PROTOCOL_VERSION),
    Snapshot(
        7,
        (
            entry(),
            WorkerEntry(DECODE, Role.DECODE, "m", 0, None, False, True, CircuitState.OPEN, 12.5, 1),
        ),
    ),
    Snapshot(0, ()),
    InflightTotals({PREFILL: 2, DECODE: 0}, 3),
    InflightTotals({}, None),
    MetricsAsk(4),
    Report(
        version=7,
        inflight={PREFILL: 1},
        idle_at={DECODE: 1234.5},
        outcomes=((PREFILL, True, 12), (PREFILL, False, 1)),
        ttft=((0.25, 0.1, "m"), (0.5, None, "")),
        tpot=((1.5, 30, "m"),),
        refused=(("m", "decode", 2),),
        connections=5,
    ),
    Suspect(DECODE),
    StuckPair(PREFILL, DECODE),
    SnapshotRefused(8, 7, "worker http://127.0.0.1:30001 appears twice"),
    MetricsAnswer(
        4,
        (("pd_router_requests", "counter", "pd_router_requests_total", {"status": "200"}, 3.0),),
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_decodes_to_the_record_it_was_encoded_from(message: Message):
    assert decode(encode(message)) == message


def test_messages_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Hello(PROTOCOL_VERSION).version = 2  # type: ignore[misc]


def test_the_hello_is_the_same_bytes_in_every_version():
    assert orjson.loads(encode(Hello(5))) == ["hello", {"version": 5}]


@pytest.mark.parametrize(
    "data",
    [
        b"{not json",
        b'{"t": "report"}',
        b'["hello"]',
        b'[1, {"version": 1}]',
        b'["goodbye", {}]',
        b'["hello", {}]',
        b'["hello", {"version": 1, "extra": 2}]',
        b'["hello", {"version": "1"}]',
        b'["hello", {"version": true}]',
        b'["hello", {"version": 1.0}]',
        b'["suspect", {"url": null}]',
        b'["metrics?", []]',
        b'["inflight", {"totals": {"a": "1"}, "share": null}]',
        b'["inflight", {"totals": [], "share": null}]',
    ],
)
def test_bytes_that_are_not_a_message_are_refused(data: bytes):
    with pytest.raises(WireError):
        decode(data)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("role", "router"),
        ("circuit", "ajar"),
        ("epoch", "3"),
        ("bootstrap_port", 8998.0),
        ("pickable", 1),
        ("half_open_at", "soon"),
        ("trial", False),
    ],
)
def test_a_worker_entry_of_the_wrong_type_is_refused_naming_the_field(field: str, value: object):
    fields = orjson.loads(encode(Snapshot(1, (entry(),))))[1]["workers"][0]
    fields[field] = value
    with pytest.raises(WireError, match=f"WorkerEntry.{field}"):
        decode(orjson.dumps(["snapshot", {"version": 1, "workers": [fields]}]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("outcomes", [[PREFILL, True]]),
        ("outcomes", [[PREFILL, 1, 2]]),
        ("ttft", [[0.1, "soon"]]),
        ("ttft", [0.1]),
        ("tpot", [[1.0, 2.5]]),
        ("inflight", {PREFILL: 1.5}),
        ("idle_at", {PREFILL: None}),
    ],
)
def test_a_report_of_the_wrong_shape_is_refused_naming_the_field(field: str, value: object):
    fields = orjson.loads(encode(MESSAGES[6]))[1]
    fields[field] = value
    with pytest.raises(WireError, match=f"Report\\.{field}"):
        decode(orjson.dumps(["report", fields]))


# --- the hello -----------------------------------------------------------------------------


def test_a_hello_of_this_version_is_taken():
    check_hello(Hello(PROTOCOL_VERSION))


def test_a_hello_of_another_version_is_refused_naming_both_versions():
    with pytest.raises(VersionMismatch) as refused:
        check_hello(Hello(PROTOCOL_VERSION + 1))
    assert refused.value.theirs == PROTOCOL_VERSION + 1
    assert str(refused.value) == (
        f"protocol version {PROTOCOL_VERSION + 1} on the other end, {PROTOCOL_VERSION} here"
    )


def test_a_first_message_that_is_not_a_hello_is_refused():
    with pytest.raises(WireError, match="Suspect before the hello"):
        check_hello(Suspect(PREFILL))


# --- consistency ---------------------------------------------------------------------------


def test_a_consistent_snapshot_is_accepted():
    check_consistent(MESSAGES[1], 6)  # type: ignore[arg-type]


def test_the_first_snapshot_may_be_version_zero():
    check_consistent(Snapshot(0, ()), NO_SNAPSHOT)


@pytest.mark.parametrize("routing", [7, 8])
def test_a_snapshot_that_is_not_newer_than_the_one_routed_from_is_refused(routing: int):
    with pytest.raises(InconsistentSnapshot, match=f"does not follow version {routing}"):
        check_consistent(Snapshot(7, (entry(),)), routing)


def test_a_snapshot_naming_a_worker_twice_is_refused():
    twice = Snapshot(2, (entry(), entry(role=Role.DECODE)))
    with pytest.raises(InconsistentSnapshot, match="appears twice"):
        check_consistent(twice, 1)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"role": "prefill"}, "is not a role"),
        ({"circuit": "closed"}, "is not a circuit state"),
        ({"epoch": 1.0}, "epoch 1.0 is not an integer"),
        ({"epoch": True}, "epoch True is not an integer"),
        ({"bootstrap_port": "8998"}, "is not a port"),
        ({"bootstrap_port": 65536}, "is not a port"),
        ({"pickable": 1}, "are not booleans"),
        ({"usable": False}, "pickable but not usable"),
        ({"half_open_at": "later"}, "is not a number"),
        ({"half_open_at": 5.0}, "closed circuit with a half-open time"),
        ({"circuit": CircuitState.HALF_OPEN, "half_open_at": 5.0}, "half-open time"),
        ({"circuit": CircuitState.OPEN, "trial": -1}, "is not a data plane"),
        ({"trial": 0}, "closed circuit with a trial holder"),
    ],
)
def test_a_snapshot_with_an_incoherent_entry_is_refused_naming_the_worker(
    changes: dict, problem: str
):
    with pytest.raises(InconsistentSnapshot, match=problem) as refused:
        check_consistent(Snapshot(2, (entry(**changes),)), 1)
    assert f"worker {PREFILL}" in str(refused.value)


def test_a_snapshot_whose_workers_are_not_entries_is_refused():
    with pytest.raises(InconsistentSnapshot, match="is not a worker entry"):
        check_consistent(Snapshot(2, ({"url": PREFILL},)), 1)  # type: ignore[arg-type]


def test_an_open_circuit_with_its_half_open_time_and_trial_holder_is_consistent():
    check_consistent(Snapshot(2, (entry(circuit=CircuitState.OPEN, half_open_at=5.0, trial=2),)), 1)


def pools() -> SnapshotPools:
    return SnapshotPools(
        {role: make_policy("round_robin") for role in Role},
        index=0,
        wake=lambda: None,
        suspect=lambda url: None,
        stuck=lambda prefill, decode: None,
        on_unavailable=lambda url: None,
        count_refusal=lambda role, model: None,
    )


def test_pools_refuse_an_inconsistent_snapshot_and_route_on_from_the_last_one():
    routing = pools()
    routing.apply(Snapshot(1, (entry(), entry(DECODE, role=Role.DECODE))))
    with pytest.raises(InconsistentSnapshot):
        routing.apply(Snapshot(2, (entry(DECODE, role=Role.DECODE, usable=False),)))
    assert routing.version == 1
    assert routing.pick(Role.PREFILL).url == PREFILL
    assert routing.pick(Role.DECODE).url == DECODE
