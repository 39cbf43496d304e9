"""Summaries of a py-spy `--format raw` profile (collapsed stacks: `frame;frame;... count`).

The raw profile is kept next to the results; this turns it into the tables that say where the
time goes: self time per function (the leaf frame of each sample), self time per source file
(which library burns the CPU), and inclusive time of the functions of one package of interest
(every such function on the stack, counted once per sample), so the entry frames every sample
shares do not crowd the table.
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
    self_by_file: Counter[str]
    inclusive_samples: Counter[str]


PATH_MARKERS = ("site-packages/", "lib/python3.11/", "/pd_router/", "/pd_worker/")


def _function(frame: str) -> tuple[str, str]:
    """`handle (/x/site-packages/aiohttp/web.py:12)` -> (`handle (aiohttp/web.py)`, file)."""
    name, sep, location = frame.partition(" (")
    if not sep:
        return frame, frame
    path = location.rstrip(")").rsplit(":", 1)[0]
    for marker in PATH_MARKERS:
        if marker in path:
            path = (
                marker.lstrip("/").removeprefix("site-packages/").removeprefix("lib/python3.11/")
                + path.split(marker, 1)[1]
            )
            break
    return f"{name} ({path})", path


def summarize(collapsed: Path, focus: str = "pd_router/") -> ProfileSummary:
    """Count samples per function in a collapsed-stack file written by py-spy.

    Inclusive time is kept only for functions whose file starts with `focus`.
    """
    self_samples: Counter[str] = Counter()
    self_by_file: Counter[str] = Counter()
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
        self_samples[frames[-1][0]] += count
        self_by_file[frames[-1][1]] += count
        for function in {name for name, path in frames if path.startswith(focus)}:
            inclusive[function] += count
    return ProfileSummary(
        total=total,
        self_samples=self_samples,
        self_by_file=self_by_file,
        inclusive_samples=inclusive,
    )


def markdown(summary: ProfileSummary, top: int = 20) -> str:
    """Markdown tables of the top entries of each count, in % of all busy samples."""
    if summary.total == 0:
        return "_no samples (was the router busy?)_\n"
    lines = [f"{summary.total} busy samples (idle event-loop waits excluded).", ""]
    tables = (
        ("self %", "function", summary.self_samples),
        ("self %", "file", summary.self_by_file),
        ("inclusive %", "function of the focus package", summary.inclusive_samples),
    )
    for title, what, counter in tables:
        lines += [f"| {title} | {what} |", "|---:|---|"]
        for function, count in counter.most_common(top):
            lines.append(f"| {100.0 * count / summary.total:.1f} | `{function}` |")
        lines.append("")
    return "\n".join(lines)
