"""CPU time of a process tree, read from /proc (Linux only), and pinning a command to cores.

A router may run as one process with many threads (smg's tokio runtime) or spawn children;
/proc/<pid>/stat already sums the threads of a process, and walking the parent links adds
the live descendants, so every peer is charged for all the CPU it burns.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name, or None if the process is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    return raw[raw.rindex(")") + 2 :].split()


def _parent_map() -> dict[int, int]:
    """pid -> ppid for every process visible now."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            parents[int(entry.name)] = int(fields[1])
    return parents


def process_tree(root: int) -> list[int]:
    """root and all its live descendants."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parent_map().items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds consumed so far by one process, all its threads; (0, 0) if
    it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0, 0.0
    # Fields 14 and 15 of stat(5) (utime, stime); index 11 and 12 after the name.
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU seconds consumed so far by root and its live descendants."""
    return sum(sum(cpu_seconds(pid)) for pid in process_tree(root))


PIN_AND_EXEC = (
    "import os, sys; os.sched_setaffinity(0, {cpus}); os.execvp(sys.argv[1], sys.argv[1:])"
)


def pinned(argv: Sequence[str], cpus: Iterable[int] | None) -> list[str]:
    """argv run on the given cores only (``taskset -c``, or the same through Python where
    there is no taskset; children inherit the mask), or unchanged when cpus is None."""
    if cpus is None:
        return list(argv)
    cores = sorted(set(cpus))
    if shutil.which("taskset"):
        return ["taskset", "-c", ",".join(str(cpu) for cpu in cores), *argv]
    return [sys.executable, "-c", PIN_AND_EXEC.format(cpus=cores), *argv]
