"""Summaries of a py-spy `--format raw` profile (collapsed stacks: `frame;frame;... count`).

The raw profile is kept next to the results; this turns it into the two tables that say where
the time goes: self time per function (the leaf frame of each sample) and inclusive time per
function (every function on the stack, counted once per sample).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProfileSummary:
    """Sample counts per function, plus the total number of samples."""

    total: int
    self_samples: Counter[str]
    inclusive_samples: Counter[str]


def _function(frame: str) -> str:
    """`handle (aiohttp/web_protocol.py:123)` -> `handle (aiohttp/web_protocol.py)`: merge lines."""
    name, sep, location = frame.partition(" (")
    if not sep:
        return frame
    path = location.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


def summarize(collapsed: Path) -> ProfileSummary:
    """Count samples per function in a collapsed-stack file written by py-spy."""
    self_samples: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_function(frame) for frame in stack.split(";") if frame]
        if not frames:
            continue
        total += count
        self_samples[frames[-1]] += count
        for function in set(frames):
            inclusive[function] += count
    return ProfileSummary(total=total, self_samples=self_samples, inclusive_samples=inclusive)


def markdown(summary: ProfileSummary, top: int = 20) -> str:
    """Two markdown tables: top self-time and top inclusive-time functions, in % of samples."""
    if summary.total == 0:
        return "_no samples (was the router busy?)_\n"
    lines = [f"{summary.total} busy samples (idle event-loop waits excluded).", ""]
    for title, counter in (
        ("self", summary.self_samples),
        ("inclusive", summary.inclusive_samples),
    ):
        lines += [f"| {title} % | function |", "|---:|---|"]
        for function, count in counter.most_common(top):
            lines.append(f"| {100.0 * count / summary.total:.1f} | `{function}` |")
        lines.append("")
    return "\n".join(lines)
