"""Recent latencies of finished requests and refusals for lack of a worker, for the autopilot.

The request path appends one (time, seconds) pair per observation to a bounded ring (a deque
append: no lock, no allocation beyond the tuple), and the autopilot reads percentiles over its
window once per interval. A stream's TTFT is split where the prefill answered: the time until
then (the prefill pool's share: queueing, forward, KV handoff) and the wait from there to the
first byte reaching the client (the decode pool's share: waiting for a batch slot, the first
step). TPOT is a stream's time from its first to its last event over the events in between.

Each model has its own rings (:class:`Latencies`): the autopilot of one model's pools reads
only that model's requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

RING_SIZE = 4096


class LatencyRecorder:
    """Bounded rings of the two shares of TTFT and of TPOT, and per-role refusal counters."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self.prefill: deque[tuple[float, float]] = deque(maxlen=size)
        self.decode_wait: deque[tuple[float, float]] = deque(maxlen=size)
        self.tpot: deque[tuple[float, float]] = deque(maxlen=size)
        self.refused: dict[str, int] = {}

    def observe_ttft(self, seconds: float, prefilled_after: float | None) -> None:
        """A stream's first byte after ``seconds``; its prefill answered after
        ``prefilled_after`` seconds (None: not yet, the whole wait is the prefill's)."""
        now = time.monotonic()
        prefill = seconds if prefilled_after is None else min(prefilled_after, seconds)
        self.prefill.append((now, prefill))
        self.decode_wait.append((now, seconds - prefill))

    def observe_stream(self, seconds_after_first: float, events: int) -> None:
        """A finished stream: ``events`` SSE events (the final ``[DONE]`` included) sent over
        ``seconds_after_first`` after the first. Streams of fewer than three events say
        nothing about the time per token."""
        if events >= 3:
            self.tpot.append((time.monotonic(), seconds_after_first / (events - 2)))

    def count_refusal(self, role: str) -> None:
        self.refused[role] = self.refused.get(role, 0) + 1


class Latencies:
    """A :class:`LatencyRecorder` per model (the request path's sink: each observation names
    the model of its request; "" for a router whose workers name none)."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._size = size
        self._models: dict[str, LatencyRecorder] = {}

    def of(self, model: str) -> LatencyRecorder:
        """The rings of ``model`` (empty ones for a model not seen yet)."""
        recorder = self._models.get(model)
        if recorder is None:
            recorder = self._models[model] = LatencyRecorder(self._size)
        return recorder

    def observe_ttft(self, seconds: float, prefilled_after: float | None, model: str) -> None:
        self.of(model).observe_ttft(seconds, prefilled_after)

    def observe_stream(self, seconds_after_first: float, events: int, model: str) -> None:
        self.of(model).observe_stream(seconds_after_first, events)

    def count_refusal(self, role: str, model: str) -> None:
        self.of(model).count_refusal(role)


def percentile_ms(
    ring: deque[tuple[float, float]], since: float, quantile: float = 0.9
) -> float | None:
    """The ``quantile`` of the samples taken at or after ``since``, in ms (None: no sample)."""
    values = sorted(value for at, value in ring if at >= since)
    return 1000.0 * quantile_of(values, quantile) if values else None


def quantile_of(ordered: Sequence[float], quantile: float) -> float:
    """The ``quantile`` of ``ordered`` (sorted, not empty): the value at ``quantile`` x n."""
    return ordered[min(len(ordered) - 1, int(quantile * len(ordered)))]


def ttft_attained(recorder: LatencyRecorder, since: float, slo_ms: float) -> float | None:
    """The share of the streams whose first byte came within ``slo_ms`` (both shares of their
    TTFT: the rings are appended together), among those observed at or after ``since``."""
    pairs = zip(recorder.prefill, recorder.decode_wait, strict=False)
    ttfts = [a + b for (at, a), (_, b) in pairs if at >= since]
    return _share_within(ttfts, slo_ms)


def tpot_attained(recorder: LatencyRecorder, since: float, slo_ms: float) -> float | None:
    """The share of the streams observed at or after ``since`` within ``slo_ms`` per token."""
    return _share_within([value for at, value in recorder.tpot if at >= since], slo_ms)


def _share_within(seconds: list[float], slo_ms: float) -> float | None:
    if not seconds:
        return None
    limit = slo_ms / 1000.0
    return sum(1 for value in seconds if value <= limit) / len(seconds)
