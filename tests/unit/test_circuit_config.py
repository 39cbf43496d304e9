"""The circuit breaker's knobs (``[circuit] enabled, success_threshold, window_secs``), on a
recorded sequence of outcomes and a hand-driven clock."""

from __future__ import annotations

import pytest

from pd_router.config import ConfigError, load_config
from pd_router.control.circuit import CircuitBreaker, CircuitConfig, CircuitState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **config: object) -> CircuitBreaker:
    return CircuitBreaker(CircuitConfig(**config), clock=clock)


def fail(cb: CircuitBreaker, times: int, clock: Clock, every_secs: float = 0.0) -> None:
    for _ in range(times):
        cb.record_failure()
        clock.now += every_secs


def test_a_disabled_circuit_never_opens():
    clock = Clock()
    cb = breaker(clock, enabled=False, failure_threshold=2)
    fail(cb, 50, clock)
    assert cb.state is CircuitState.CLOSED
    assert cb.allows()


def test_half_open_needs_success_threshold_trials_to_close():
    clock = Clock()
    cb = breaker(clock, failure_threshold=1, cooldown_secs=5.0, success_threshold=3)
    fail(cb, 1, clock)
    clock.now += 5.0
    for _ in range(2):
        assert cb.allows()
        cb.record_success()
        assert cb.state is CircuitState.HALF_OPEN
    cb.record_success()
    assert cb.state is CircuitState.CLOSED


def test_a_run_of_successes_counts_as_that_many_trials():
    clock = Clock()
    cb = breaker(clock, failure_threshold=1, cooldown_secs=5.0, success_threshold=3)
    fail(cb, 1, clock)
    clock.now += 5.0
    cb.record_success(2)
    assert cb.state is CircuitState.HALF_OPEN
    cb.record_success(1)
    assert cb.state is CircuitState.CLOSED


def test_a_failed_trial_reopens_and_the_next_half_open_counts_from_zero():
    clock = Clock()
    cb = breaker(clock, failure_threshold=1, cooldown_secs=5.0, success_threshold=2)
    fail(cb, 1, clock)
    clock.now += 5.0
    cb.record_success()
    cb.record_failure()
    assert cb.state is CircuitState.OPEN
    clock.now += 5.0
    cb.record_success()
    assert cb.state is CircuitState.HALF_OPEN
    cb.record_success()
    assert cb.state is CircuitState.CLOSED


def test_without_a_window_a_success_between_failures_keeps_the_circuit_closed():
    clock = Clock()
    cb = breaker(clock, failure_threshold=3)
    for _ in range(10):
        fail(cb, 2, clock)
        cb.record_success()
    assert cb.state is CircuitState.CLOSED


def test_with_a_window_failures_open_it_despite_successes_between_them():
    clock = Clock()
    cb = breaker(clock, failure_threshold=3, window_secs=60.0)
    for _ in range(2):
        cb.record_failure()
        cb.record_success()
        clock.now += 10.0
    cb.record_failure()
    assert cb.state is CircuitState.OPEN


def test_with_a_window_failures_spread_wider_than_it_do_not_open_it():
    clock = Clock()
    cb = breaker(clock, failure_threshold=3, window_secs=60.0)
    fail(cb, 30, clock, every_secs=31.0)
    assert cb.state is CircuitState.CLOSED


def test_circuit_keys_are_read_from_the_config():
    config = load_config(
        None, {"circuit": {"enabled": False, "success_threshold": 3, "window_secs": 30}}
    )
    assert config.circuit == CircuitConfig(enabled=False, success_threshold=3, window_secs=30.0)


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"circuit": {"success_threshold": 0}}, "circuit.success_threshold"),
        ({"circuit": {"window_secs": -1}}, "circuit.window_secs"),
        ({"circuit": {"enabled": "no"}}, "circuit.enabled"),
    ],
)
def test_invalid_circuit_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as caught:
        load_config(None, data)
    assert caught.value.key == key
