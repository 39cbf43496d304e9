"""Real request traces for the benchmarks: read, merge, cut, compress and thin them.

A trace file is a CSV of logged requests, ``TIMESTAMP,ContextTokens,GeneratedTokens`` (the Azure
LLM inference trace 2023 format; ``bench/traces/`` holds two such files and their attribution).
Reading keeps the absolute timestamps so that traces of one hour merge in time; everything after
:func:`offsets` works on :class:`TraceRequest` lists, whose send times are seconds from the
trace's first request. Every function is pure: the same arguments give the same trace.

The reference workers need no cap on tokens: the longest prompt of the two files (14,050 tokens)
fits the ``h100-8b`` profile's prefill budget (16,384 tokens a batch) and KV capacity (557,000),
and the longest answer (1,899 tokens) streams in seconds.
"""

from __future__ import annotations

import csv
import heapq
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

TRACES = Path(__file__).resolve().parent / "traces"
KNOWN = {
    "azure_code": TRACES / "azure_code_2023.csv",
    "azure_conv": TRACES / "azure_conv_2023.csv",
}


class TraceError(ValueError):
    """A trace that cannot be read or an option that leaves nothing to replay."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it is sent (seconds from the trace's start, modeled), the
    phase or window it is counted in, and how big it is."""

    at: float
    phase: int
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Logged:
    """One request as a trace file logged it: its UTC time and token counts."""

    stamp: datetime
    prompt_tokens: int
    output_tokens: int


def resolve(name: str) -> Path:
    """The file of a known trace name (``azure_code``, ``azure_conv``) or a path as given.

    Raises TraceError for a name that is neither, listing the known names."""
    if name in KNOWN:
        return KNOWN[name]
    path = Path(name)
    if not path.is_file():
        raise TraceError(f"no trace {name!r}: neither a file nor one of {', '.join(KNOWN)}")
    return path


def read_trace(path: Path) -> list[Logged]:
    """The requests of one CSV trace in file order (the files are sorted by time).

    Timestamps keep microseconds (the files log 100 ns). Raises TraceError naming the line of
    a malformed row, or for a file without requests."""
    logged = []
    with path.open(newline="") as file:
        for line, row in enumerate(csv.DictReader(file), start=2):
            try:
                logged.append(
                    Logged(
                        datetime.fromisoformat(row["TIMESTAMP"]),
                        int(row["ContextTokens"]),
                        int(row["GeneratedTokens"]),
                    )
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{line}: not a trace row ({exc})") from exc
    if not logged:
        raise TraceError(f"{path}: no requests")
    return logged


def merge(traces: Sequence[Sequence[Logged]]) -> list[Logged]:
    """Several traces interleaved by time; requests logged at the same instant keep the order
    of the traces as given, so the merge is deterministic."""
    return list(heapq.merge(*traces, key=lambda logged: logged.stamp))


def offsets(logged: Sequence[Logged]) -> list[TraceRequest]:
    """The requests with send times in seconds from the first one's (all in phase 0)."""
    start = logged[0].stamp
    return [
        TraceRequest((r.stamp - start).total_seconds(), 0, r.prompt_tokens, r.output_tokens)
        for r in logged
    ]


def window(trace: Iterable[TraceRequest], start_min: float, end_min: float) -> list[TraceRequest]:
    """The requests sent from minute ``start_min`` (inclusive) to ``end_min`` (exclusive) of
    the trace, their send times shifted so that the window starts at 0."""
    if not 0 <= start_min < end_min:
        raise TraceError(f"window {start_min:g}:{end_min:g} is not 0 <= start < end minutes")
    start, end = start_min * 60, end_min * 60
    return [replace(r, at=r.at - start) for r in trace if start <= r.at < end]


def compress(trace: Iterable[TraceRequest], factor: float) -> list[TraceRequest]:
    """The requests sent ``factor`` times faster: with 6 a minute of the trace plays in 10 s,
    at six times its request rate, each request keeping its size."""
    if factor <= 0:
        raise TraceError(f"compression factor must be > 0, got {factor:g}")
    return [replace(r, at=r.at / factor) for r in trace]


def thin(trace: Sequence[TraceRequest], keep: float, seed: int) -> list[TraceRequest]:
    """Each request kept with probability ``keep``, independently, drawn from ``seed``: the
    same seed keeps the same requests, and the rate falls by ``keep`` while the mix of sizes
    and its shifts over time stay the trace's."""
    if not 0 < keep <= 1:
        raise TraceError(f"the share of requests kept must be in (0, 1], got {keep:g}")
    rng = random.Random(seed)
    return [r for r in trace if rng.random() < keep]


def in_windows(trace: Iterable[TraceRequest], count: int, duration: float) -> list[TraceRequest]:
    """The requests with ``phase`` set to the one of ``count`` equal windows of ``duration``
    seconds they are sent in (a real trace has no phases; reports count per window)."""
    if count < 1 or duration <= 0:
        raise TraceError(f"cannot split {duration:g} s into {count} windows")
    width = duration / count
    return [replace(r, phase=min(int(r.at // width), count - 1)) for r in trace]


@dataclass(frozen=True)
class Replay:
    """A trace ready to replay: its requests, counted in windows, and its span in seconds."""

    requests: list[TraceRequest]
    duration: float


def prepare(
    logged: Sequence[Logged],
    *,
    minutes: tuple[float, float] | None,
    factor: float,
    keep: float,
    seed: int,
    windows: int,
) -> Replay:
    """The logged requests cut to ``minutes`` (the whole trace when None), compressed by
    ``factor``, thinned to ``keep`` with ``seed`` and counted in ``windows`` equal windows.

    The span is the window's length (the whole trace: up to its last request) over the
    factor. Raises TraceError for a bad option or when no request is left."""
    trace = offsets(logged)
    if minutes is not None:
        trace = window(trace, *minutes)
        span = (minutes[1] - minutes[0]) * 60
    else:
        span = trace[-1].at
    trace = thin(compress(trace, factor), keep, seed)
    if not trace:
        raise TraceError("no request of the trace is left to replay")
    duration = span / factor
    return Replay(in_windows(trace, windows, duration), duration)
