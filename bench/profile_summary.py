"""Summaries of a `py-spy record --native --format raw` profile (collapsed stacks).

py-spy counts a thread as busy when it is runnable, so on a loaded 2-core machine a router
that is waiting inside `epoll_pwait` or was preempted inside `write` (a loopback write wakes the
receiving process) still collects samples there. Those samples say nothing about what our code
costs: samples whose leaf frame is a libc syscall wrapper are counted apart (the kernel's share
of CPU is measured exactly from /proc stime anyway), and the tables are built from the rest,
the user-space samples. Each such sample is charged to its deepest Python frame (native
frames below it, such as aiohttp's C parser or object deallocation, belong to that call), or
to `GC` when the cyclic garbage collector is on the stack. Inclusive time is given for the
functions of one package of interest (pd_router), counted once per sample.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SYSCALL_LIBRARIES = ("libc.so.6", "libpthread.so.0")
GC_FRAME = "gc_collect_main"
PATH_MARKERS = ("site-packages/", "lib/python3.11/", "/pd_router/", "/pd_worker/")


@dataclass(frozen=True)
class Frame:
    """One stack frame: function, source file relative to its package root, and whether it
    is Python code (a .py file) rather than native code."""

    name: str
    path: str

    @property
    def is_python(self) -> bool:
        return self.path.endswith(".py")

    @property
    def label(self) -> str:
        return f"{self.name} ({self.path})"


@dataclass(frozen=True)
class ProfileSummary:
    """Sample counts: all, in syscalls, and per Python function/file of user-space samples."""

    total: int
    in_syscalls: Counter[str]
    user: int
    self_samples: Counter[str]
    self_by_file: Counter[str]
    inclusive_samples: Counter[str]


def parse_frame(text: str) -> Frame:
    """`handle (/x/site-packages/aiohttp/web.py:12)` -> Frame("handle", "aiohttp/web.py")."""
    name, sep, location = text.partition(" (")
    if not sep:
        return Frame(text, "")
    path = location.rstrip(")").rsplit(":", 1)[0]
    for marker in PATH_MARKERS:
        if marker in path:
            root = marker.strip("/").removeprefix("site-packages").removeprefix("lib/python3.11")
            path = (root + "/" if root else "") + path.split(marker, 1)[1]
            break
    return Frame(name, path)


def _charge(frames: list[Frame]) -> Frame:
    """The frame a user-space sample is charged to: GC, else the deepest Python frame."""
    if any(frame.name == GC_FRAME for frame in frames):
        return Frame("gc_collect_main", "cyclic GC")
    python = [frame for frame in frames if frame.is_python]
    return python[-1] if python else frames[-1]


def summarize(collapsed: Path, focus: str = "pd_router/") -> ProfileSummary:
    """Count samples of a collapsed-stack file written by py-spy (see the module docstring)."""
    in_syscalls: Counter[str] = Counter()
    self_samples: Counter[str] = Counter()
    self_by_file: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = user = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [parse_frame(text) for text in stack.split(";") if text]
        if not frames:
            continue
        total += count
        if frames[-1].path in SYSCALL_LIBRARIES:
            in_syscalls[frames[-1].name] += count
            continue
        user += count
        charged = _charge(frames)
        self_samples[charged.label] += count
        self_by_file[charged.path] += count
        for label in {frame.label for frame in frames if frame.path.startswith(focus)}:
            inclusive[label] += count
    return ProfileSummary(total, in_syscalls, user, self_samples, self_by_file, inclusive)


def markdown(summary: ProfileSummary, top: int = 20) -> str:
    """Markdown tables of the top entries of each count, in % of user-space samples."""
    if summary.user == 0:
        return "_no user-space samples (was the router busy?)_\n"
    syscalls = ", ".join(f"{name} {count}" for name, count in summary.in_syscalls.most_common(4))
    lines = [
        f"{summary.total} samples; {summary.total - summary.user} with a syscall on top "
        f"({syscalls}), left out; percentages below are of the {summary.user} user-space "
        "samples.",
        "",
    ]
    tables = (
        (
            "self %",
            "deepest Python frame (native callees included), GC apart",
            summary.self_samples,
        ),
        ("self %", "file", summary.self_by_file),
        ("inclusive %", "pd_router function", summary.inclusive_samples),
    )
    for title, what, counter in tables:
        lines += [f"| {title} | {what} |", "|---:|---|"]
        for key, count in counter.most_common(top):
            lines.append(f"| {100.0 * count / summary.user:.1f} | `{key}` |")
        lines.append("")
    return "\n".join(lines)
