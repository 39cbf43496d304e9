"""Per-worker circuit breaker fed by request outcomes.

Consecutive failures open the circuit; after a cool-down one trial request is let through
(half-open); its success closes the circuit, its failure opens it again. A worker whose circuit
is open is not selected, so a broken worker stops costing retries long before the health probe
notices.

Recovery. One trial per worker is right while other workers carry the traffic, but after an
outage every circuit is open or half-open at once, and a burst would get one request per worker
through and 503 for the rest. Two rules keep that from happening:

- the health monitor closes (:meth:`CircuitBreaker.reset`) the circuit of a worker it saw
  recover (unhealthy -> healthy, a drain ending, a restart): the failures were the outage the
  probes saw, and the worker answers again;
- when no worker of a pool is selectable although some are ACTIVE and healthy, so that only
  their circuits keep them out, requests go to those workers anyway (Envoy's panic mode; a data
  plane's ``SnapshotPools.pick``): the circuit exists to steer traffic to other workers, and
  there are none. A success then closes the circuit it went through.

Half-open stays at one trial in flight: with the pool-wide rule a burst is no longer limited by
it, and while other workers serve, one trial is enough to learn that a worker is back. This
breaker decides the states from the outcomes the data planes report; the data planes route by
them and hold the one trial (:class:`pd_router.dataplane.routing.snapshot.SharedCircuit`,
:mod:`pd_router.control.trials`).

The knobs the peers have (sglang-router's and smg's ``--cb-*`` flags): ``success_threshold``
trials must succeed in a row to close a half-open circuit; ``window_secs`` > 0 opens the circuit
on ``failure_threshold`` failures within that many seconds, successes in between or not (smg
accepts a window but counts consecutive failures only); ``enabled = false`` keeps every circuit
closed, so only the health probes take a worker out.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pd_router.circuit_state import CircuitState

__all__ = ["CIRCUIT_STATE_VALUES", "CircuitBreaker", "CircuitConfig", "CircuitState"]


@dataclass(frozen=True)
class CircuitConfig:
    failure_threshold: int = 5
    cooldown_secs: float = 10.0
    enabled: bool = True
    success_threshold: int = 1
    window_secs: float = 0.0


class CircuitBreaker:
    """Closed -> open after ``failure_threshold`` failures (consecutive, or within
    ``window_secs``) -> half-open after ``cooldown_secs`` -> closed after ``success_threshold``
    successful trials, open again on one failure. Disabled: always closed."""

    def __init__(
        self,
        config: CircuitConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[CircuitState], None] | None = None,
    ) -> None:
        self.config = config or CircuitConfig()
        self._clock = clock
        self._on_change = on_change
        self._state = CircuitState.CLOSED
        # When the last ``failure_threshold`` failures happened: enough to tell whether that
        # many fell within the window, and bounded whatever the failure rate.
        self._failures: deque[float] = deque(maxlen=self.config.failure_threshold)
        self._trial_successes = 0
        self._opened_at = 0.0

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._cooled_down():
            self._set(CircuitState.HALF_OPEN)
        return self._state

    @property
    def half_open_at(self) -> float | None:
        """When an open circuit turns half-open (``time.monotonic``, which every process of
        the machine shares); None unless open."""
        if self._state is not CircuitState.OPEN:
            return None
        return self._opened_at + self.config.cooldown_secs

    def allows(self) -> bool:
        """Whether the circuit lets requests through (closed, or half-open: its one trial is
        held by a data plane)."""
        return self._state is CircuitState.CLOSED or self.state is not CircuitState.OPEN

    def record_success(self, count: int = 1) -> None:
        """``count`` requests succeeded in a row: consecutive counting starts over; a half-open
        circuit closes once ``success_threshold`` trials succeeded in a row."""
        if not self.config.window_secs:
            self._failures.clear()
        if self.state is CircuitState.CLOSED:
            return
        self._trial_successes += count
        if self._trial_successes >= self.config.success_threshold:
            self._failures.clear()
            self._set(CircuitState.CLOSED)

    def record_failure(self) -> None:
        if not self.config.enabled:
            return
        now = self._clock()
        self._failures.append(now)
        state = self.state
        if state is CircuitState.HALF_OPEN or (
            state is CircuitState.CLOSED and self._threshold_reached(now)
        ):
            self._opened_at = now
            self._set(CircuitState.OPEN)

    def reset(self) -> None:
        """Forget past failures (a worker re-added by an operator starts closed)."""
        self._failures.clear()
        self._set(CircuitState.CLOSED)

    def _threshold_reached(self, now: float) -> bool:
        """``failure_threshold`` failures recorded, all within the window when there is one."""
        if len(self._failures) < self.config.failure_threshold:
            return False
        window = self.config.window_secs
        return not window or now - self._failures[0] <= window

    def _cooled_down(self) -> bool:
        return self._clock() - self._opened_at >= self.config.cooldown_secs

    def _set(self, state: CircuitState) -> None:
        if state is self._state:
            return
        self._state = state
        self._trial_successes = 0
        if self._on_change is not None:
            self._on_change(state)


CIRCUIT_STATE_VALUES = {CircuitState.CLOSED: 0, CircuitState.OPEN: 1, CircuitState.HALF_OPEN: 2}
