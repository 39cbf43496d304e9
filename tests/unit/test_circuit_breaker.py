"""The circuit breaker's states on a clock the test moves (pd_router/control/circuit.py), and
the trial hand-over's bookkeeping (pd_router/control/trials.py): when a holder is named, kept,
taken and forgotten."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pd_router.circuit_state import CircuitState
from pd_router.control.circuit import CIRCUIT_STATE_VALUES, CircuitBreaker, CircuitConfig
from pd_router.control.trials import HalfOpenTrials
from tests.unit.clock import FakeClock

CLOSED, OPEN, HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN
URL = "http://10.0.0.1:30000"


class Breaker:
    """A breaker (3 failures, 10 s cool-down) on a fake clock, recording each state change."""

    def __init__(self, **config: object) -> None:
        self.clock = FakeClock()
        self.changes: list[CircuitState] = []
        self.circuit = CircuitBreaker(
            CircuitConfig(**{"failure_threshold": 3, "cooldown_secs": 10.0, **config}),  # type: ignore[arg-type]
            clock=self.clock,
            on_change=self.changes.append,
        )

    def fail(self, times: int = 1) -> None:
        for _ in range(times):
            self.circuit.record_failure()

    def opened(self) -> Breaker:
        self.fail(3)
        assert self.circuit.state is OPEN
        return self

    def half_open(self) -> Breaker:
        self.opened()
        self.clock.advance(10.0)
        assert self.circuit.state is HALF_OPEN
        return self


# --- the breaker ------------------------------------------------------------------------------


def test_a_new_circuit_is_closed_and_lets_requests_through():
    b = Breaker()
    assert (b.circuit.state, b.circuit.allows(), b.circuit.half_open_at) == (CLOSED, True, None)


def test_failures_below_the_threshold_keep_it_closed():
    b = Breaker()
    b.fail(2)
    assert b.circuit.state is CLOSED and b.changes == []


def test_the_threshold_of_failures_opens_it():
    b = Breaker()
    b.fail(3)
    assert (b.circuit.state, b.circuit.allows()) == (OPEN, False)
    assert b.changes == [OPEN]


def test_an_open_circuit_says_when_it_turns_half_open():
    b = Breaker().opened()
    assert b.circuit.half_open_at == b.clock.now + 10.0


def test_an_open_circuit_stays_open_until_its_cool_down_has_passed():
    b = Breaker().opened()
    b.clock.advance(9.999)
    assert b.circuit.state is OPEN and not b.circuit.allows()


def test_after_the_cool_down_it_is_half_open_and_lets_the_trial_through():
    b = Breaker().opened()
    b.clock.advance(10.0)
    assert b.circuit.allows()
    assert b.changes == [OPEN, HALF_OPEN]
    assert b.circuit.half_open_at is None


def test_a_successful_trial_closes_it():
    b = Breaker().half_open()
    b.circuit.record_success()
    assert b.circuit.state is CLOSED
    assert b.changes == [OPEN, HALF_OPEN, CLOSED]


def test_a_failed_trial_opens_it_again_for_a_whole_cool_down():
    b = Breaker().half_open()
    b.fail()
    assert b.circuit.state is OPEN
    b.clock.advance(9.0)
    assert b.circuit.state is OPEN
    b.clock.advance(1.0)
    assert b.circuit.state is HALF_OPEN


def test_after_closing_it_counts_failures_from_zero():
    b = Breaker().half_open()
    b.circuit.record_success()
    b.fail(2)
    assert b.circuit.state is CLOSED


def test_a_reset_closes_an_open_circuit_and_forgets_its_failures():
    b = Breaker().opened()
    b.circuit.reset()
    assert b.circuit.state is CLOSED
    b.fail(2)
    assert b.circuit.state is CLOSED


def test_a_reset_of_a_closed_circuit_tells_nobody():
    b = Breaker()
    b.circuit.reset()
    assert b.changes == []


def test_a_disabled_circuit_ignores_failures():
    b = Breaker(enabled=False)
    b.fail(10)
    assert b.circuit.state is CLOSED and b.changes == []


def test_a_success_on_a_closed_circuit_changes_nothing_but_the_count():
    b = Breaker()
    b.fail(2)
    b.circuit.record_success()
    b.fail(2)
    assert b.circuit.state is CLOSED and b.changes == []


def test_with_a_window_the_oldest_failure_must_be_recent_enough():
    b = Breaker(window_secs=5.0)
    b.fail(2)
    b.clock.advance(6.0)
    b.fail(2)
    assert b.circuit.state is CLOSED
    b.fail()
    assert b.circuit.state is OPEN


@pytest.mark.parametrize(("state", "value"), [(CLOSED, 0), (OPEN, 1), (HALF_OPEN, 2)])
def test_the_exported_state_values(state, value):
    assert CIRCUIT_STATE_VALUES[state] == value


# --- the trial hand-over's bookkeeping --------------------------------------------------------


@dataclass
class Plane:
    """A data plane as its last report shows it."""

    connections: int = 0
    acked: int = 0
    inflight: dict[str, int] = field(default_factory=dict)


def test_a_holder_is_kept_from_one_snapshot_to_the_next():
    trials = HalfOpenTrials()
    planes = {0: Plane(connections=1), 1: Plane(connections=3)}
    assert trials.holder(URL, False, planes, 1) == 1
    planes[0].connections = 9
    assert trials.holder(URL, False, planes, 2) == 1
    assert not trials.unsettled(planes)


def test_a_holder_left_without_clients_makes_the_trials_unsettled():
    trials = HalfOpenTrials()
    planes = {0: Plane(connections=1), 1: Plane(connections=3)}
    trials.holder(URL, False, planes, 1)
    planes[1].connections = 0
    assert trials.unsettled(planes)


def test_a_move_names_nobody_until_the_old_holder_acked_and_drained():
    trials = HalfOpenTrials()
    planes = {0: Plane(connections=1), 1: Plane(connections=3)}
    trials.holder(URL, False, planes, 1)
    planes[1].connections = 0
    planes[1].inflight = {URL: 1}
    planes[1].acked = 1
    # Holder 1 has a trial in flight: it keeps it.
    assert trials.holder(URL, False, planes, 2) == 1
    planes[1].inflight = {}
    assert trials.holder(URL, False, planes, 3) is None
    assert not trials.unsettled(planes)
    planes[1].acked = 3
    assert trials.unsettled(planes)
    assert trials.holder(URL, False, planes, 4) == 0


def test_a_move_waits_while_the_old_holder_still_has_the_worker_in_flight():
    trials = HalfOpenTrials()
    planes = {0: Plane(connections=1), 1: Plane(connections=3)}
    trials.holder(URL, False, planes, 1)
    planes[1].connections = 0
    assert trials.holder(URL, False, planes, 2) is None
    planes[1].acked = 2
    planes[1].inflight = {URL: 1}
    assert trials.holder(URL, False, planes, 3) is None


def test_closing_the_circuit_drops_its_holder_and_any_move():
    trials = HalfOpenTrials()
    planes = {0: Plane(connections=1)}
    trials.holder(URL, False, planes, 1)
    assert trials.holder(URL, True, planes, 2) is None
    assert not trials.unsettled(planes)


def test_forgotten_workers_are_dropped_and_known_ones_kept():
    trials = HalfOpenTrials()
    planes = {0: Plane(connections=1), 1: Plane(connections=3)}
    trials.holder(URL, False, planes, 1)
    trials.holder("http://10.0.0.2:30000", False, planes, 1)
    trials.forget({URL})
    planes[1].connections = 0
    # Only the known worker's trial would move.
    assert trials.unsettled(planes)
    trials.forget(set())
    assert not trials.unsettled(planes)
