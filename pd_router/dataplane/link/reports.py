"""What a data plane tells the control process, in batches over its channel.

A report (:class:`~pd_router.wire.Report`) carries the snapshot version this process routes
from (its ack), its in-flight count per worker and when each idle one became idle, the leg
outcomes for the circuits, the TTFT and TPOT samples and the refusals for lack of a worker that
the autopilot reads, and its open client connections (the control process balances them). One
goes out every ``interval`` when something changed, at once after a snapshot was taken (the ack
a conversion's drain waits for) and when a worker out of selection became idle here, and at
least every ``HEARTBEAT_SECS`` (of the wire) even if nothing did: the control process takes a
data plane that fell silent for hung, and replaces it. A leg answered for the other role is
told at once (:class:`~pd_router.wire.Suspect`), a pair that missed its rendezvous
(:class:`~pd_router.wire.StuckPair`), a snapshot that was not applied as well
(:class:`~pd_router.wire.SnapshotRefused`), and the metrics go out when the control process
asks for them (a scrape) and every :data:`METRICS_PUSH_SECS` unasked, so a data plane that dies
between scrapes takes at most that much of its counts with it. The data plane of a one-process
router counts into the process's own metrics, which the control side shows as they are: it
sends no samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sized

from pd_router.dataplane.routing.snapshot import SnapshotPools
from pd_router.wire import (
    HEARTBEAT_SECS,
    ChannelEnd,
    MetricsAnswer,
    Report,
    SnapshotRefused,
    StuckPair,
    Suspect,
)

REPORT_INTERVAL_SECS = 0.025
METRICS_PUSH_SECS = 1.0
# The request number of metrics sent unasked (a scrape's are numbered from 1).
UNASKED = 0


class Reports:
    """The batch of one data plane; also the request path's latency sink."""

    def __init__(
        self,
        channel: ChannelEnd,
        samples: Callable[[], list[list]],
        connections: Sized,
        interval: float = REPORT_INTERVAL_SECS,
    ) -> None:
        self._channel = channel
        self._samples = samples
        self._connections = connections
        self._last_connections = 0
        self._interval = interval
        self._urgent = asyncio.Event()
        self._ttft: list[tuple[float, float | None, str]] = []
        self._tpot: list[tuple[float, int, str]] = []
        self._refused: dict[tuple[str, str], int] = {}
        self._last_counts: dict[str, int] = {}
        self._sent_at = self._metrics_sent_at = time.monotonic()

    # --- the latency sink (LatencyRecorder's methods the request path calls) ----------------

    def observe_ttft(self, seconds: float, prefilled_after: float | None, model: str) -> None:
        self._ttft.append((seconds, prefilled_after, model))

    def observe_stream(self, seconds_after_first: float, events: int, model: str) -> None:
        self._tpot.append((seconds_after_first, events, model))

    def count_refusal(self, role: str, model: str) -> None:
        key = (model, role)
        self._refused[key] = self._refused.get(key, 0) + 1

    # --- sending ----------------------------------------------------------------------------

    def wake(self) -> None:
        """Send the next report now rather than at the end of the interval."""
        self._urgent.set()

    def suspect(self, url: str) -> None:
        self._channel.send(Suspect(url))

    def stuck(self, prefill: str, decode: str) -> None:
        self._channel.send(StuckPair(prefill, decode))

    def refused(self, version: int, routing: int, reason: str) -> None:
        """Tell the control side snapshot ``version`` was not applied (``reason``)."""
        self._channel.send(SnapshotRefused(version, routing, reason))

    def send_metrics(self, request: int) -> None:
        self._channel.send(MetricsAnswer(request, tuple(map(tuple, self._samples()))))

    def send(self, pools: SnapshotPools, *, force: bool = False) -> None:
        """Report what changed since the last report (``force``: report even if nothing did)."""
        counts, idle = pools.inflight_report()
        outcomes = pools.take_outcomes()
        connections = len(self._connections)
        if not (force or outcomes or self._ttft or self._tpot or self._refused) and (
            counts == self._last_counts and connections == self._last_connections
        ):
            return
        self._last_counts = counts
        self._last_connections = connections
        self._sent_at = time.monotonic()
        self._channel.send(
            Report(
                version=pools.version,
                inflight=counts,
                idle_at=idle,
                outcomes=outcomes,
                ttft=tuple(self._ttft),
                tpot=tuple(self._tpot),
                refused=tuple((model, role, n) for (model, role), n in self._refused.items()),
                connections=connections,
            )
        )
        self._ttft, self._tpot, self._refused = [], [], {}

    async def run(self, pools: SnapshotPools) -> None:
        """Report every interval (sooner when woken) until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), self._interval)
            self._urgent.clear()
            now = time.monotonic()
            self.send(pools, force=now - self._sent_at >= HEARTBEAT_SECS)
            if now - self._metrics_sent_at >= METRICS_PUSH_SECS:
                self._metrics_sent_at = now
                self.send_metrics(UNASKED)
