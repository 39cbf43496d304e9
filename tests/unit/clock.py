"""A clock for the code that takes one (``clock: Callable[[], float] = time.monotonic``): time
moves only when a test says so, by :meth:`FakeClock.advance` or by ``step`` on every read."""

from __future__ import annotations


class FakeClock:
    """Reads ``now``; each read then moves it on by ``step`` (0: it stands still)."""

    def __init__(self, now: float = 1000.0, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now

    def advance(self, secs: float) -> None:
        self.now += secs
