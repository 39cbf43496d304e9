"""Fleet simulator: static P:D splits against the autopilot on a real trace, at any fleet size.

The fleet is modeled (``bench/fleet_model.py``: the reference worker's timing model, profile
``h100-8b``, its queues, least-inflight routing, drains and switch time), and the autopilot is the
router's own policy code (``pd_router.control.autopilot.policy``) fed the samples its controller
would take, with the ``[autopilot]`` settings ``bench/rebalance.py`` gives the router. So a trace
that takes minutes to replay against processes takes seconds here, at 4 workers or 512.

The trace is read as ``bench/rebalance.py --trace`` reads it (merged, cut to ``--trace-window``
minutes, ``--compress``-ed, thinned to ``--keep``, reported in ``--windows`` windows). A fleet
larger than the one the trace was thinned for gets ``--load-scale K`` copies of every request
(``--scale-load``: K = workers / 4), each sent at a seeded random time between the request and
the trace's next one, so the rate follows the trace's shape K times over.

Configurations: every static split from 1 prefill to N-1 (for N > 16, every N/16th, plus the
middle; ``--sweep-step S``: every S-th; ``--static P,Q``: those prefill counts, to refine the
search around the best), the autopilot started from the middle split
(``--start P``: from P prefills) and ``autopilot-restart``, the restart-based planner
(Dynamo's way, as ``bench/rebalance.py`` builds it): the same policy, but every role switch
takes ``--restart-secs`` modeled seconds, a restart and weight reload (0: not run).
``--decode-step-ms 9.5``: a decode step's fixed part as the reference worker measured it on 8
and 16 processes (the profile says 9 ms).
Reported per configuration: goodput (requests per second meeting both SLOs over the trace), SLO
attainment per window, TTFT and TPOT p50/p90, conversions (and the worker-seconds their drains
and switches kept out of service), CPU seconds the simulation took. Then two references found
in hindsight from the static sweep: the best static split (the one-off offline search for the
whole run, what DistServe-style placement gives) and the best split per window (each window's
best static goodput, summed: the ceiling a policy that moves servers at no cost could reach);
each autopilot's ratio to both, its conversions per hour and the time its drains lost; and the
conversions it decided, with reasons.

    .venv/bin/python bench/fleet_sim.py --trace azure_code,azure_conv --trace-window 18:54 \\
        --compress 6 --keep 0.45 --workers 32 --decode-batch-cap 32 --scale-load

Exit status 2 on bad arguments or a trace that cannot be read.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleet_model import Fleet, FleetResult  # noqa: E402
from rebalance import (  # noqa: E402
    TRACE_PEAK_SECS,
    Outcome,
    Slo,
    Workload,
    attainment_by_phase,
    default_autopilot,
    goodput,
    goodput_by_phase,
    latency_columns,
    minute_range,
    trace_workload,
)
from traces import TraceError, TraceRequest, in_windows  # noqa: E402

from pd_router.config import build_autopilot  # noqa: E402
from pd_router.control.autopilot.policy import AutopilotConfig, AutopilotPolicy  # noqa: E402
from pd_worker.timing import TimingModel, profile  # noqa: E402

PROFILE = "h100-8b"
# The trace's thinning (--keep 0.45 of Azure merged) was chosen for 4 workers.
BASE_WORKERS = 4
# Above this many workers the static sweep takes every N/16th split.
FULL_SWEEP = 16


@dataclass(frozen=True)
class Setup:
    """One configuration: its name, starting split, whether the autopilot runs, and how many
    servers it may convert at once (``[conversion] max_concurrent``)."""

    name: str
    prefill: int
    decode: int
    autopilot: bool = False
    moves: int = 1
    # A role switch's modeled seconds (None: the timing model's); a restart's for
    # autopilot-restart.
    switch_secs: float | None = None


@dataclass
class SimRun:
    """One configuration's figures; the requests themselves are not kept (a fleet of 512
    replays a million of them per configuration)."""

    setup: Setup
    result: FleetResult
    goodput: float
    attainment: list[float]
    # Goodput of the requests sent in each window, per second of the window.
    by_window: list[float]
    failed: int
    cpu_secs: float
    latencies: str


def scale_load(trace: Sequence[TraceRequest], factor: int, seed: int) -> list[TraceRequest]:
    """Each request ``factor`` times: the original and copies sent at seeded random times
    between it and the trace's next request (the last one's copies within a second), so the
    rate is ``factor`` times the trace's with its shape kept."""
    if factor <= 1:
        return list(trace)
    rng = random.Random(seed)
    scaled = []
    for i, request in enumerate(trace):
        gap = trace[i + 1].at - request.at if i + 1 < len(trace) else 1.0
        scaled.append(request)
        scaled += [replace(request, at=request.at + rng.random() * gap) for _ in range(factor - 1)]
    return sorted(scaled, key=lambda r: r.at)


def splits(workers: int, step: int | None = None, only: Sequence[int] = ()) -> list[int]:
    """The prefill counts of the static sweep: ``only`` where given, else every ``step``-th
    of 1..N-1 and the middle; by default all of them up to 16 workers, every N/16th above."""
    if only:
        return sorted(set(only))
    if step is None:
        step = 1 if workers <= FULL_SWEEP else workers // FULL_SWEEP
    return sorted({*range(step, workers, step), workers // 2})


def setups(
    workers: int,
    only: str | None,
    start: int | None = None,
    step: int | None = None,
    moves: int = 1,
    restart_secs: float = 0.0,
    static_splits: Sequence[int] = (),
) -> list[Setup]:
    """The static sweep (every ``step``-th split), the autopilot from ``start`` prefills
    (default: half), converting up to ``moves`` servers at once, and with ``restart_secs``
    the same autopilot paying a restart of that long for each switch."""
    static = [
        Setup(f"static {p}P{workers - p}D", p, workers - p)
        for p in splits(workers, step, static_splits)
    ]
    first = workers // 2 if start is None else start
    name = f"from {first}P{workers - first}D"
    if moves > 1:
        name += f", {moves} at once"
    auto = [Setup(f"autopilot {name}", first, workers - first, autopilot=True, moves=moves)]
    if restart_secs > 0:
        restart = f"autopilot-restart {name}, {restart_secs:g} s restarts"
        auto.append(replace(auto[0], name=restart, switch_secs=restart_secs))
    if only == "static":
        return static
    if only == "autopilot":
        return auto
    return static + auto


def fleet_timing(batch_cap: int, decode_step_ms: float | None = None) -> TimingModel:
    """The workers' timing model: the profile's, with ``decode_step_ms`` as a decode step's
    fixed part where given (the reference worker's steps measured about 9.5 ms on 8 and 16
    processes against the profile's 9: the half millisecond decides decode-bound splits)."""
    timing = profile(PROFILE, max_running_requests=batch_cap)
    if decode_step_ms is None:
        return timing
    return replace(timing, decode_step_base_secs=decode_step_ms / 1000)


def autopilot_config(slo: Slo) -> AutopilotConfig:
    """The ``[autopilot]`` section bench/rebalance.py gives the router (modeled seconds)."""
    toml = default_autopilot(1.0, slo, TRACE_PEAK_SECS)
    return build_autopilot(tomllib.loads(toml)["autopilot"])


def simulate(
    setup: Setup,
    trace: list[TraceRequest],
    timing: TimingModel,
    work: Workload,
    slo: Slo,
    seed: int,
    *,
    keep_samples: bool = False,
) -> SimRun:
    policy = None
    if setup.autopilot:
        policy = AutopilotPolicy(
            autopilot_config(slo), min_prefill=1, min_decode=1, max_moves=setup.moves
        )
    if setup.switch_secs is not None:
        timing = replace(timing, switch_secs=setup.switch_secs)
    began = time.process_time()
    fleet = Fleet(
        timing, setup.prefill, setup.decode, seed=seed, policy=policy, keep_samples=keep_samples
    )
    result = fleet.run(trace)
    cpu = time.process_time() - began
    outcomes = [
        Outcome(r.trace, error=r.error) if r.error else Outcome(r.trace, r.ttft, r.tpot)
        for r in result.requests
    ]
    result.requests = []
    return SimRun(
        setup,
        result,
        goodput(outcomes, slo, work.duration),
        attainment_by_phase(outcomes, slo, len(work.heads)),
        goodput_by_phase(outcomes, slo, len(work.heads), work.duration / len(work.heads)),
        sum(o.error is not None for o in outcomes),
        cpu,
        latency_columns(outcomes),
    )


# --- report ---------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return "-" if value != value else f"{100 * value:.0f}%"


def out_of_service(result: FleetResult) -> tuple[float, float]:
    """The modeled worker-seconds the ended conversions spent draining and switching."""
    ended = [c for c in result.conversions if c.ended is not None and c.drained is not None]
    drain = sum(c.drained - c.started for c in ended)  # type: ignore[operator]
    switch = sum(c.ended - c.drained for c in ended)  # type: ignore[operator]
    return drain, switch


def conversion_text(result: FleetResult) -> str:
    """How many conversions ended, and the modeled seconds they kept a worker out of service."""
    ended = [c for c in result.conversions if c.ended is not None]
    if not result.conversions:
        return "0"
    text = f"{len(ended)} ({sum(out_of_service(result)):.0f} worker-s out)"
    unfinished = len(result.conversions) - len(ended)
    return text + (f" +{unfinished} unfinished" if unfinished else "")


def per_window_best(runs: list[SimRun]) -> tuple[list[SimRun], float]:
    """Each window's best static run and the goodput of taking each window's best: the
    ceiling of a policy that could move servers at no cost between windows."""
    static = [r for r in runs if not r.setup.autopilot]
    count = len(static[0].by_window)
    best = [max(static, key=lambda r, w=w: r.by_window[w]) for w in range(count)]
    return best, sum(r.by_window[w] for w, r in enumerate(best)) / count


def hindsight_text(runs: list[SimRun], work: Workload, compress: float) -> list[str]:
    """The autopilot runs against the best static split in hindsight (the one-off offline
    search for the whole run) and the best split per window in hindsight (the ceiling), with
    their conversions per hour of the trace and the worker-seconds their drains lost."""
    static = [r for r in runs if not r.setup.autopilot]
    auto = [r for r in runs if r.setup.autopilot]
    if not static or not auto:
        return []
    best = max(static, key=lambda r: r.goodput)
    windows, ceiling = per_window_best(runs)
    hours = work.duration * compress / 3600
    splits = ", ".join(
        f"{head} {r.setup.prefill}P{r.setup.decode}D"
        for head, r in zip(work.heads, windows, strict=True)
    )
    lines = [
        "",
        f"- Best static split in hindsight (the one-off offline search for the whole run): "
        f"{best.setup.prefill}P{best.setup.decode}D, {best.goodput:.2f} req/s.",
        f"- Best split per window in hindsight (the ceiling; {splits}): {ceiling:.2f} req/s, "
        f"{ceiling / best.goodput:.2f}x the best static split.",
        "",
        "| configuration | goodput | vs best static split | vs best split per window "
        "| conversions | per trace hour | drain worker-s | switch worker-s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in auto:
        drain, switch = out_of_service(run.result)
        count = len(run.result.conversions)
        lines.append(
            f"| {run.setup.name} | {run.goodput:.2f} | {run.goodput / best.goodput:.2f}x "
            f"| {run.goodput / ceiling:.2f}x | {count} | {count / hours:.0f} | {drain:.0f} "
            f"| {switch:.0f} | {run.failed} |"
        )
    return lines


def report(
    runs: list[SimRun], work: Workload, slo: Slo, requests: int, args: argparse.Namespace
) -> str:
    static = [r.goodput for r in runs if not r.setup.autopilot]
    best = max(static, default=0.0)
    heads = " | ".join(work.heads)
    lines = [
        f"# Fleet simulation ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        f"- Fleet: {args.workers} modeled reference workers, profile `{PROFILE}`, decode batch "
        f"cap {args.decode_batch_cap}"
        + (f", decode step {args.decode_step_ms:g} ms fixed" if args.decode_step_ms else "")
        + ", least-inflight routing (bench/fleet_model.py).",
        f"- Trace: {work.description}; load x{args.load_scale} ({requests} requests).",
        f"- SLOs: TTFT <= {slo.ttft_secs * 1000:.0f} ms, TPOT <= {slo.tpot_secs * 1000:.0f} ms; "
        "goodput = requests meeting both / trace duration.",
        "",
        f"| configuration | goodput (req/s) | vs best static | {heads} | TTFT p50/p90 ms "
        "| TPOT p50/p90 ms | conversions | failed "
        "| CPU s |",
        "|---|---|---|" + "---|" * len(work.heads) + "---|---|---|---|---|",
    ]
    for run in runs:
        value = run.goodput
        ratio = f"{value / best:.2f}x" if best > 0 else "-"
        name = (
            f"**{run.setup.name}**" if value == best and not run.setup.autopilot else run.setup.name
        )
        lines.append(
            f"| {name} | {value:.2f} | {ratio} | {' | '.join(_pct(s) for s in run.attainment)} | "
            f"{run.latencies} | "
            f"{conversion_text(run.result)} | {run.failed} | {run.cpu_secs:.2f} |"
        )
    lines += hindsight_text(runs, work, args.compress)
    for run in runs:
        if run.result.decisions:
            lines += ["", f"Decisions of {run.setup.name} (modeled s):", ""]
            lines += [f"- {d.at:.0f} s: {d.action}: {d.reason}" for d in run.result.decisions]
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default="azure_code,azure_conv")
    parser.add_argument("--trace-window", type=minute_range, default=None, metavar="START:END")
    parser.add_argument("--compress", type=float, default=1.0)
    parser.add_argument("--keep", type=float, default=1.0)
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seed", type=int, default=10, help="thinning, copies and routing")
    parser.add_argument("--workers", type=int, default=BASE_WORKERS)
    parser.add_argument("--decode-batch-cap", type=int, default=32)
    parser.add_argument("--load-scale", type=int, default=1, help="copies of each request")
    parser.add_argument(
        "--scale-load", action="store_true", help=f"--load-scale workers/{BASE_WORKERS}"
    )
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-ms", type=float, default=30.0)
    parser.add_argument("--only", choices=("static", "autopilot"), default=None)
    parser.add_argument(
        "--start", type=int, default=None, help="prefills the autopilot starts with (N/2)"
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=1,
        help="servers the autopilot may convert at once ([conversion] max_concurrent)",
    )
    parser.add_argument(
        "--restart-secs",
        type=float,
        default=60.0,
        help="modeled restart of autopilot-restart's switches (0: not run)",
    )
    parser.add_argument(
        "--sweep-step",
        type=int,
        default=None,
        help=f"static splits every this many prefills (1 up to {FULL_SWEEP} workers, N/16 above)",
    )
    parser.add_argument(
        "--static",
        type=lambda text: [int(p) for p in text.split(",")],
        default=[],
        metavar="P,Q",
        help="run these static splits (prefill counts) instead of the sweep",
    )
    parser.add_argument(
        "--decode-step-ms",
        type=float,
        default=None,
        help=f"a decode step's fixed part (default: profile {PROFILE}'s; 9.5 ms is what the "
        "reference worker measured on 8 and 16 processes)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--trail",
        type=Path,
        default=None,
        help="write the autopilot's samples and decisions, every tick, here (JSON)",
    )
    args = parser.parse_args(argv)
    if args.workers < 2 or args.load_scale < 1 or args.decode_batch_cap < 1:
        parser.error("--workers must be >= 2, --load-scale and --decode-batch-cap >= 1")
    if args.start is not None and not 0 < args.start < args.workers:
        parser.error("--start must leave at least one prefill and one decode")
    if args.restart_secs < 0:
        parser.error("--restart-secs must be >= 0")
    if any(not 0 < p < args.workers for p in args.static):
        parser.error("--static splits must leave at least one prefill and one decode")
    if args.sweep_step is not None and args.sweep_step < 1:
        parser.error("--sweep-step must be >= 1")
    if args.decode_step_ms is not None and args.decode_step_ms <= 0:
        parser.error("--decode-step-ms must be > 0")
    if args.scale_load:
        args.load_scale = max(1, args.workers // BASE_WORKERS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        work = trace_workload(args)
    except TraceError as exc:
        print(f"fleet_sim: {exc}", file=sys.stderr)
        return 2
    trace = in_windows(
        scale_load(work.trace, args.load_scale, args.seed), args.windows, work.duration
    )
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000)
    timing = fleet_timing(args.decode_batch_cap, args.decode_step_ms)
    runs = []
    configurations = setups(
        args.workers,
        args.only,
        args.start,
        args.sweep_step,
        args.max_concurrent,
        args.restart_secs,
        args.static,
    )
    for setup in configurations:
        print(f"fleet_sim: {setup.name} ({len(trace)} requests)", file=sys.stderr, flush=True)
        keep = args.trail is not None and setup.autopilot
        runs.append(simulate(setup, trace, timing, work, slo, args.seed, keep_samples=keep))
    text = report(runs, work, slo, len(trace), args)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.trail is not None:
        ticks = [
            {"sample": sample.to_json(), "decision": decision.to_json()}
            for run in runs
            for sample, decision in run.result.ticks
        ]
        args.trail.write_bytes(orjson.dumps(ticks, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
