"""The registry's state machine (pd_router/control/workers.py): every pair of worker states,
allowed or refused, through the public method that asks for it, and what each step does to the
worker, the pools and the listeners."""

from __future__ import annotations

import itertools

import pytest

from pd_router.control.workers import (
    CONVERTING,
    TRANSITIONS,
    InvalidTransition,
    RegistryError,
    Unavailability,
    UnknownWorker,
    Worker,
    WorkerConverting,
    WorkerRegistry,
    WorkerRemoving,
    WorkerState,
)
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role

A, D, S, F, R = (
    WorkerState.ACTIVE,
    WorkerState.DRAINING,
    WorkerState.SWITCHING,
    WorkerState.FAILED,
    WorkerState.REMOVING,
)
# The specification: which state may follow which (docs/router.md, "Worker states").
ALLOWED = {
    (A, D), (A, R),
    (D, A), (D, S), (D, F),
    (S, A), (S, F),
    (F, A), (F, R),
    (R, A),
}  # fmt: skip
PAIRS = [(a, b) for a, b in itertools.product(WorkerState, WorkerState) if a is not b]
URL = "http://10.0.0.1:30000"
CONVERSION = "c1"


def registry() -> WorkerRegistry:
    return WorkerRegistry(RouterMetrics())


def worker_in(reg: WorkerRegistry, state: WorkerState, role: Role = Role.PREFILL) -> Worker:
    """A worker brought to ``state`` by the public steps that lead there (held by conversion
    ``c1`` while DRAINING or SWITCHING)."""
    worker = reg.add(URL, role, 8998)
    if state in (D, S, F):
        reg.claim_for_conversion(worker, CONVERSION, lambda: None)
    if state is S:
        reg.advance_conversion(worker, CONVERSION, S)
    if state is F:
        reg.end_conversion(worker, CONVERSION, F, error="broken")
    if state is R:
        reg.begin_removal(worker)
    assert worker.state is state
    return worker


def ask_for(reg: WorkerRegistry, worker: Worker, target: WorkerState) -> None:
    """Call the public method that moves a worker to ``target`` from where it is: the holding
    conversion's steps while one holds it, else the claim, the re-add, the re-admission or the
    removal."""
    holder = worker.conversion_id or "c9"
    if target is D:
        if worker.conversion_id is None:
            reg.claim_for_conversion(worker, holder, lambda: None)
        else:
            reg.advance_conversion(worker, holder, D)
    elif target is S:
        reg.advance_conversion(worker, holder, S)
    elif target is F:
        reg.end_conversion(worker, holder, F)
    elif target is R:
        reg.begin_removal(worker)
    elif worker.conversion_id is not None:
        reg.end_conversion(worker, holder, A)
    elif worker.state is R:
        reg.readmit(worker)
    else:
        reg.add(worker.url, worker.role)


def test_the_transition_table_is_the_specified_one():
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert table == ALLOWED


def test_the_converting_states_are_draining_and_switching():
    assert frozenset({D, S}) == CONVERTING


@pytest.mark.parametrize(("start", "target"), [p for p in PAIRS if p in ALLOWED])
def test_an_allowed_transition_moves_the_worker(start, target):
    reg = registry()
    worker = worker_in(reg, start)
    ask_for(reg, worker, target)
    assert worker.state is target


@pytest.mark.parametrize(("start", "target"), [p for p in PAIRS if p not in ALLOWED])
def test_a_refused_transition_raises_and_changes_nothing(start, target):
    reg = registry()
    worker = worker_in(reg, start)
    before = (worker.state, worker.conversion_id, worker.role, worker.epoch)
    with pytest.raises(RegistryError):
        ask_for(reg, worker, target)
    assert (worker.state, worker.conversion_id, worker.role, worker.epoch) == before


@pytest.mark.parametrize("start", [D, S])
def test_another_conversion_cannot_move_a_held_worker(start):
    reg = registry()
    worker = worker_in(reg, start)
    with pytest.raises(WorkerConverting):
        reg.end_conversion(worker, "c2", A)
    with pytest.raises(WorkerConverting):
        reg.advance_conversion(worker, "c2", S)
    assert worker.state is start and worker.conversion_id == CONVERSION


@pytest.mark.parametrize("start", [D, S])
def test_a_held_worker_cannot_be_removed(start):
    reg = registry()
    worker = worker_in(reg, start)
    with pytest.raises(WorkerConverting):
        reg.begin_removal(worker)
    with pytest.raises(WorkerConverting):
        reg.check_removable(worker)


def test_a_removing_worker_cannot_be_claimed_or_added_again():
    reg = registry()
    worker = worker_in(reg, R)
    with pytest.raises(WorkerRemoving):
        reg.claim_for_conversion(worker, "c2", lambda: None)
    with pytest.raises(WorkerRemoving):
        reg.add(URL, Role.DECODE)


def test_a_failed_check_leaves_the_worker_unclaimed():
    reg = registry()
    worker = worker_in(reg, A)

    def refuse() -> None:
        raise RegistryError("no")

    with pytest.raises(RegistryError):
        reg.claim_for_conversion(worker, CONVERSION, refuse)
    assert worker.state is A and worker.conversion_id is None


def test_a_conversion_cannot_end_in_a_converting_state():
    reg = registry()
    worker = worker_in(reg, D)
    with pytest.raises(InvalidTransition):
        reg.end_conversion(worker, CONVERSION, S)


def test_advance_takes_only_converting_states():
    reg = registry()
    worker = worker_in(reg, D)
    with pytest.raises(InvalidTransition):
        reg.advance_conversion(worker, CONVERSION, A)


def test_forget_takes_only_a_removing_worker():
    reg = registry()
    worker = worker_in(reg, A)
    with pytest.raises(InvalidTransition):
        reg.forget(worker)
    reg.begin_removal(worker)
    reg.forget(worker)
    assert len(reg) == 0
    with pytest.raises(UnknownWorker):
        reg.get(URL)


def test_readmit_takes_only_a_removing_worker():
    reg = registry()
    worker = worker_in(reg, A)
    with pytest.raises(InvalidTransition):
        reg.readmit(worker)


def test_a_forgotten_worker_cannot_be_moved():
    reg = registry()
    worker = worker_in(reg, R)
    reg.forget(worker)
    with pytest.raises(UnknownWorker):
        reg.readmit(worker)


def test_a_conversion_ending_in_a_new_role_moves_the_pool_and_bumps_the_epoch():
    reg = registry()
    worker = worker_in(reg, S)
    left: list[tuple[Worker, Role]] = []
    reg.on_left_pool(lambda w, role: left.append((w, role)))
    reg.end_conversion(worker, CONVERSION, A, role=Role.DECODE, bootstrap_port=None)
    assert (worker.role, worker.epoch, worker.conversion_id) == (Role.DECODE, 1, None)
    assert reg.in_role(Role.DECODE) == [worker] and reg.in_role(Role.PREFILL) == []
    assert left == [(worker, Role.PREFILL)]


def test_a_conversion_ending_in_the_old_role_keeps_the_epoch():
    reg = registry()
    worker = worker_in(reg, D)
    reg.end_conversion(worker, CONVERSION, A)
    assert (worker.role, worker.epoch) == (Role.PREFILL, 0)


def test_a_new_role_closes_the_circuit():
    reg = registry()
    worker = worker_in(reg, S)
    for _ in range(worker.circuit.config.failure_threshold):
        worker.circuit.record_failure()
    assert not worker.circuit.allows()
    reg.end_conversion(worker, CONVERSION, A, role=Role.DECODE)
    assert worker.circuit.allows()


def test_failing_keeps_the_error_and_tells_the_listeners():
    reg = registry()
    worker = worker_in(reg, S)
    told: list[tuple[Worker, Unavailability]] = []
    reg.on_unavailable(lambda w, why: told.append((w, why)))
    reg.end_conversion(worker, CONVERSION, F, error="no answer")
    assert worker.last_error == "no answer"
    assert told == [(worker, Unavailability.FAILED)]


def test_draining_and_removing_do_not_tell_the_unavailability_listeners():
    reg = registry()
    told: list[Unavailability] = []
    reg.on_unavailable(lambda w, why: told.append(why))
    first = reg.add(URL, Role.PREFILL)
    second = reg.add("http://10.0.0.2:30000", Role.PREFILL)
    reg.claim_for_conversion(first, CONVERSION, lambda: None)
    reg.begin_removal(second)
    assert told == []


def test_forgetting_tells_the_listeners_it_was_removed():
    reg = registry()
    worker = worker_in(reg, R)
    told: list[Unavailability] = []
    reg.on_unavailable(lambda w, why: told.append(why))
    reg.forget(worker)
    assert told == [Unavailability.REMOVED]


def test_a_failing_listener_does_not_undo_the_change_or_silence_the_others():
    reg = registry()
    worker = worker_in(reg, S)
    told: list[Unavailability] = []

    def broken(w: Worker, why: Unavailability) -> None:
        raise RuntimeError("listener bug")

    reg.on_unavailable(broken)
    reg.on_unavailable(lambda w, why: told.append(why))
    reg.end_conversion(worker, CONVERSION, F)
    assert worker.state is F and told == [Unavailability.FAILED]


def test_re_adding_a_failed_worker_brings_it_back_closed_and_healthy_in_the_given_role():
    reg = registry()
    worker = worker_in(reg, F)
    reg.set_health(worker, False, "down")
    worker.circuit.reset()
    for _ in range(worker.circuit.config.failure_threshold):
        worker.circuit.record_failure()
    again = reg.add(URL, Role.DECODE)
    assert again is worker
    assert (worker.state, worker.role, worker.healthy, worker.last_error) == (
        A, Role.DECODE, True, None,
    )  # fmt: skip
    assert worker.circuit.allows()


def test_adding_a_known_active_worker_is_refused():
    reg = registry()
    worker_in(reg, A)
    with pytest.raises(RegistryError) as refused:
        reg.add(URL + "/", Role.PREFILL)
    assert refused.value.reason == "duplicate_worker"


@pytest.mark.parametrize("state", list(WorkerState))
def test_only_an_active_healthy_admitting_worker_with_a_closed_circuit_is_selectable(state):
    reg = registry()
    worker = worker_in(reg, state)
    assert worker.selectable is (state is A)
    assert reg.selectable(Role.PREFILL) == ([worker] if state is A else [])


@pytest.mark.parametrize(
    "spoil",
    [
        lambda reg, w: reg.set_health(w, False),
        lambda reg, w: reg.set_admitting(w, False),
        lambda reg, w: [w.circuit.record_failure() for _ in range(5)],
    ],
    ids=["unhealthy", "not admitting", "circuit open"],
)
def test_an_active_worker_leaves_selection_when(spoil):
    reg = registry()
    worker = worker_in(reg, A)
    spoil(reg, worker)
    assert not worker.selectable


@pytest.mark.parametrize("state", list(WorkerState))
def test_the_pool_size_counts_only_active_workers(state):
    metrics = RouterMetrics()
    reg = WorkerRegistry(metrics)
    worker_in(reg, state)
    size = metrics.registry.get_sample_value("pd_router_pool_size", {"role": "prefill"})
    assert size == (1 if state is A else 0)


@pytest.mark.parametrize("state", list(WorkerState))
def test_the_state_metric_follows_the_state(state):
    metrics = RouterMetrics()
    reg = WorkerRegistry(metrics)
    worker_in(reg, state)
    for s in WorkerState:
        value = metrics.registry.get_sample_value(
            "pd_router_worker_state", {"worker": URL, "state": s.value}
        )
        assert value == (1 if s is state else 0), s


def test_every_change_a_data_plane_routes_by_tells_the_change_listeners():
    reg = registry()
    changes: list[None] = []
    reg.on_change(lambda: changes.append(None))
    worker = reg.add(URL, Role.PREFILL)
    steps = [
        lambda: reg.set_health(worker, False),
        lambda: reg.set_health(worker, True),
        lambda: reg.set_admitting(worker, False),
        lambda: reg.set_bootstrap_port(worker, 9000),
        lambda: reg.claim_for_conversion(worker, CONVERSION, lambda: None),
        lambda: reg.end_conversion(worker, CONVERSION, A),
    ]
    for step in steps:
        before = len(changes)
        step()
        assert len(changes) > before, step


def test_a_probe_answer_about_a_forgotten_worker_is_dropped():
    reg = registry()
    worker = worker_in(reg, R)
    reg.forget(worker)
    reg.set_health(worker, False, "late")
    reg.note_error(worker, "late")
    assert worker.healthy and worker.last_error is None


class TestPeers:
    """What another router replica decided, applied here."""

    def test_a_peer_conversion_holds_an_active_worker_through_draining(self):
        reg = registry()
        worker = worker_in(reg, A)
        reg.hold_for_peer(worker, "r1-c1", S)
        assert (worker.state, worker.conversion_id) == (S, "r1-c1")

    def test_a_peer_conversion_cannot_take_a_worker_held_by_another(self):
        reg = registry()
        worker = worker_in(reg, D)
        with pytest.raises(WorkerConverting):
            reg.hold_for_peer(worker, "r1-c1", D)

    def test_a_peer_conversion_cannot_hold_a_removing_worker(self):
        reg = registry()
        worker = worker_in(reg, R)
        with pytest.raises(WorkerRemoving):
            reg.hold_for_peer(worker, "r1-c1", D)

    def test_a_peer_release_takes_the_shared_role_and_epoch(self):
        reg = registry()
        worker = worker_in(reg, A)
        reg.hold_for_peer(worker, "r1-c1", S)
        reg.release_from_peer(worker, "r1-c1", A, role=Role.DECODE, bootstrap_port=None, epoch=7)
        assert (worker.state, worker.role, worker.epoch, worker.conversion_id) == (
            A, Role.DECODE, 7, None,
        )  # fmt: skip

    def test_following_a_peer_record_changes_role_and_epoch_not_state(self):
        reg = registry()
        worker = worker_in(reg, F)
        reg.follow_peer(worker, role=Role.DECODE, bootstrap_port=None, epoch=3)
        assert (worker.state, worker.role, worker.epoch) == (F, Role.DECODE, 3)


def test_adopting_a_role_moves_a_free_active_worker_and_tells_the_listeners():
    reg = registry()
    worker = worker_in(reg, A)
    adopted: list[Worker] = []
    reg.on_adopted(adopted.append)
    reg.adopt_role(worker, Role.DECODE)
    assert (worker.role, worker.epoch, adopted) == (Role.DECODE, 1, [worker])


@pytest.mark.parametrize("state", [D, S, F, R])
def test_only_a_free_active_worker_adopts_a_role(state):
    reg = registry()
    worker = worker_in(reg, state)
    with pytest.raises(RegistryError):
        reg.adopt_role(worker, Role.DECODE)
    assert worker.role is Role.PREFILL


def test_the_pool_minimum_counts_active_healthy_admitting_workers_but_the_one_leaving():
    reg = registry()
    first = reg.add(URL, Role.PREFILL)
    second = reg.add("http://10.0.0.2:30000", Role.PREFILL)
    assert reg.remaining_below(first, 1) is None
    reg.set_admitting(second, False)
    assert reg.remaining_below(first, 1) == 0


async def test_the_in_flight_count_from_the_reports_sets_the_idle_event():
    reg = registry()
    worker = worker_in(reg, A)
    reg.set_inflight(worker, 2, 0.0)
    assert not worker._idle.is_set()
    reg.set_inflight(worker, 0, 12.5)
    await worker.wait_until_no_inflight()
    assert (worker.inflight, worker.idle_at) == (0, 12.5)


async def test_a_worker_picked_elsewhere_is_waited_for_until_every_plane_dropped_it():
    reg = registry()
    worker = worker_in(reg, A)
    reg.set_picked_elsewhere(worker, True)
    assert worker.picked_elsewhere
    reg.set_picked_elsewhere(worker, False)
    await worker.wait_until_unpicked()
    assert not worker.picked_elsewhere
