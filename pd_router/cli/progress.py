"""A running conversion as ``pd-router convert`` shows it: once a second its phase, the
requests the router still has in flight on the worker and the worker's load, until it ends. On
a terminal one line is redrawn in place behind a bar of the drain (the share of the router's
requests in flight at its start that have finished); elsewhere one plain line per second.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

POLL_SECS = 1.0
BAR_WIDTH = 24
CLEAR_LINE = "\r\x1b[K"


def drained_fraction(progress: dict[str, Any]) -> float:
    """How much of the router's in-flight count at the drain's start has finished (0..1)."""
    start = progress.get("router_inflight_at_start") or 0
    now = progress.get("router_inflight")
    if not start or now is None:
        return 1.0 if now == 0 else 0.0
    return max(0.0, min(1.0, (start - now) / start))


def describe(record: dict[str, Any], elapsed: float) -> str:
    """One line: the phase, the router's requests in flight on the worker, the other router
    replicas whose requests on it the drain still waits for, the worker's load
    (``worker_load`` tokens; running and waiting requests once the worker's own idleness is
    awaited), the time so far."""
    progress = record.get("progress", {})
    parts = [str(record.get("status"))]
    if "router_inflight" in progress:
        at_start = progress.get("router_inflight_at_start")
        of = f" of {at_start}" if at_start is not None else ""
        parts.append(f"in-flight {progress['router_inflight']}{of}")
    replicas = progress.get("waiting_for_replicas")
    if record.get("status") == "draining" and replicas:
        parts.append(f"waiting for replica{'s' if len(replicas) > 1 else ''} "
                     f"{', '.join(replicas)} to end their requests on it")  # fmt: skip
    load = record.get("worker_load")
    if isinstance(load, int) and load >= 0:
        parts.append(f"worker load {load} tokens")
    if "worker_running" in progress:
        parts.append(
            f"running {progress['worker_running']} waiting {progress.get('worker_waiting', 0)}"
        )
    parts.append(f"{elapsed:.0f}s")
    return "  ".join(parts)


def bar(record: dict[str, Any]) -> str:
    draining = record.get("status") == "draining"
    fraction = drained_fraction(record.get("progress", {})) if draining else 1.0
    filled = round(fraction * BAR_WIDTH)
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


class ProgressView:
    """Where the updates go: redrawn in place on a terminal, appended otherwise."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()
        self._drawn = False

    def update(self, record: dict[str, Any]) -> None:
        line = describe(record, time.monotonic() - self.started)
        if self.tty:
            self.out.write(f"{CLEAR_LINE}{bar(record)} {line}")
            self._drawn = True
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def end_line(self) -> None:
        """Leave the redrawn line as it is and move below it."""
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False


def follow(
    fetch: Callable[[], dict[str, Any]],
    view: ProgressView,
    finished: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    """Poll ``fetch`` once a second, showing each record, until ``finished``; the last record."""
    while True:
        record = fetch()
        if finished(record):
            view.end_line()
            return record
        view.update(record)
        time.sleep(POLL_SECS)
