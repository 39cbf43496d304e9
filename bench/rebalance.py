"""Rebalancing benchmark: static P:D splits against the autopilot on a trace that shifts phase.

A reference cluster of ``--workers`` pd_worker processes (4 by default; timing profile
``h100-8b``: Llama-3.1-8B on one H100, see docs/PERFORMANCE.md "Timing model") sits behind
pd-router (its own process). This
process replays one seeded trace against it per configuration: Poisson arrivals, prompt-heavy
phases (long prompts, short answers) alternating with answer-heavy phases (short prompts, long
answers), every request streamed so that its time to first token (TTFT) and time per output
token (TPOT) are measured at the client. Times are reported in modeled seconds (wall / speed).

Configurations: static 1P3D, 2P2D and 3P1D (nothing converts; for N workers a quarter, half and
three quarters of them prefills, or the prefill counts of ``--splits``); ``autopilot`` (from the
middle split, the router's ``[autopilot]`` section with mode "auto"); ``autopilot-restart`` (the
same, but every role switch takes ``--restart-secs`` modeled seconds, the cost of a restart and
weight reload).
The autopilot configurations are skipped with a message when the router refuses the section.

With ``--trace`` the configurations replay real traces instead (``bench/traces.py``: the Azure
LLM inference 2023 code and conversation services in ``bench/traces/``, or CSV files of the same
format), merged by time, cut to ``--trace-window`` minutes, played ``--compress`` times faster
and thinned to ``--keep`` of the requests with ``--seed``; a real trace has no phases, so it is
reported in ``--windows`` equal windows. ``--scale-load`` sends each request workers/4 times
(``--load-scale K``: K times), the copies bench/fleet_sim.py sends, so that a fleet larger than
four gets the trace's mix at the rate the thinning chose for four, and ``--simulate`` runs the
fleet simulator on the same requests and reports its goodput beside the real one.

Reported per configuration: goodput (requests per second meeting both the TTFT and the TPOT SLO,
over the trace), SLO attainment per phase (per window, with goodput per window, for a real
trace), conversions made, failed requests. The report goes to
bench/results/rebalance-<timestamp>.md and the plot of goodput and pool sizes over time to
docs/img/rebalance.png, for a real trace next to the report (matplotlib:
``pip install -e '.[bench]'``).

    .venv/bin/python bench/rebalance.py                       # every configuration (~13 min)
    .venv/bin/python bench/rebalance.py --only static         # the three static splits
    .venv/bin/python bench/rebalance.py --autopilot-config ap.toml   # [autopilot] section to use
    .venv/bin/python bench/rebalance.py --trace azure_code,azure_conv --compress 6 --keep 0.2

Exit status 2 on bad arguments or a missing matplotlib (unless --no-plot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from router_process import router_toml, running_router  # noqa: E402
from traces import (  # noqa: E402
    KNOWN,
    TraceError,
    TraceRequest,
    in_windows,
    merge,
    prepare,
    read_trace,
    resolve,
)

from pd_router.config import ConfigError, build_config  # noqa: E402
from pd_router.control.conversion.history import FINAL  # noqa: E402
from pd_worker.cluster import WorkerCluster  # noqa: E402
from pd_worker.timing import profile  # noqa: E402

RESULTS = REPO / "bench" / "results"
PLOT = REPO / "docs" / "img" / "rebalance.png"
PROFILE = "h100-8b"
# A conversion may wait for long answers of the modeled model to finish.
DRAIN_TIMEOUT_SECS = 600.0
WORKER_WAIT_SECS = 600.0
REQUEST_READ_TIMEOUT_S = 600.0
TOKEN_IDS = range(1, 30001)


# --- the trace ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What one kind of phase sends: prompt and answer lengths (uniform, inclusive) and rate."""

    name: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    rate: float


# Sized against this machine's reference workers: a prefill forwards ~25k prompt tokens/s, a
# decode at 4 running requests streams ~350 tokens/s (the model's 440 less the timers'
# overhead of two shared cores). A prompt-heavy phase asks ~56k prompt tokens/s: 2 prefills
# fall behind by an eighth, 3 keep up at 75%. An answer-heavy phase keeps ~5.8 answers running
# (of 4 slots per decode): 2 decodes keep up at 70%, 1 falls behind by nearly half. The other
# pool's share of each phase fits on one server. So 3P1D suits the prompt-heavy phases, 2P2D
# the answer-heavy ones, and no static split suits both. Both phases send about as many
# requests, so neither dominates goodput.
PROMPT_HEAVY = Shape("prompt-heavy", (4000, 12000), (2, 10), 7.0)
ANSWER_HEAVY = Shape("answer-heavy", (100, 300), (40, 80), 8.3)


@dataclass(frozen=True)
class TraceSpec:
    """Everything the trace depends on; the same spec gives the same trace."""

    seed: int = 10
    phases: int = 6
    phase_secs: float = 60.0
    load: float = 1.0
    # Answer-heavy first: the cluster starts in the balanced split that suits it, as a
    # cluster that ran steadily before the traffic shifted would be.
    shapes: tuple[Shape, Shape] = (ANSWER_HEAVY, PROMPT_HEAVY)

    @property
    def duration(self) -> float:
        return self.phases * self.phase_secs


@dataclass(frozen=True)
class Phase:
    index: int
    shape: Shape
    start: float
    end: float


def phases(spec: TraceSpec) -> list[Phase]:
    """The phases in order, alternating the two shapes, ``spec.shapes[0]`` first."""
    return [
        Phase(i, spec.shapes[i % 2], i * spec.phase_secs, (i + 1) * spec.phase_secs)
        for i in range(spec.phases)
    ]


def make_trace(spec: TraceSpec) -> list[TraceRequest]:
    """Poisson arrivals at each phase's rate (times ``load``) with uniform lengths, seeded."""
    rng = random.Random(spec.seed)
    trace: list[TraceRequest] = []
    for phase in phases(spec):
        shape = phase.shape
        at = phase.start
        while (at := at + rng.expovariate(shape.rate * spec.load)) < phase.end:
            trace.append(
                TraceRequest(
                    at,
                    phase.index,
                    rng.randint(*shape.prompt_tokens),
                    rng.randint(*shape.output_tokens),
                )
            )
    return trace


@dataclass(frozen=True)
class Workload:
    """What every configuration replays, and how the report and the plot name its parts: one
    column per phase of the synthetic trace or per window of a real one."""

    trace: list[TraceRequest]
    duration: float
    heads: list[str]
    description: str
    # Spans the plot shades grey, and what the grey means.
    shaded: list[tuple[float, float]]
    shading: str
    goal_ratio: float
    goodput_per_window: bool = False


def synthetic_workload(spec: TraceSpec) -> Workload:
    """The phase-shifting synthetic trace, the prompt-heavy phases shaded."""
    trace = make_trace(spec)
    description = (
        f"seed {spec.seed}, {spec.phases} phases of {spec.phase_secs:.0f} modeled s "
        f"({len(trace)} requests), load x{spec.load}; "
        + "; ".join(
            f"{s.name}: {s.rate * spec.load:g} req/s, prompt {s.prompt_tokens[0]}-"
            f"{s.prompt_tokens[1]}, answer {s.output_tokens[0]}-{s.output_tokens[1]} tokens"
            for s in spec.shapes
        )
    )
    return Workload(
        trace,
        spec.duration,
        [f"{p.shape.name[0].upper()}{p.index + 1}" for p in phases(spec)],
        description,
        [(p.start, p.end) for p in phases(spec) if p.shape.name == PROMPT_HEAVY.name],
        "prompt-heavy phases",
        GOAL_RATIO,
    )


# The goal on a real trace (Azure merged, 4 workers): at least the best static split.
TRACE_GOAL_RATIO = 1.0


def trace_workload(args: argparse.Namespace) -> Workload:
    """The real traces named by ``--trace``, merged, cut, compressed and thinned as the
    options say, counted in ``--windows`` equal windows (every other one shaded).

    Raises TraceError for a trace that cannot be read or options that leave nothing."""
    names = [name.strip() for name in args.trace.split(",")]
    logged = merge([read_trace(resolve(name)) for name in names])
    replay = prepare(
        logged,
        minutes=args.trace_window,
        factor=args.compress,
        keep=args.keep,
        seed=args.seed,
        windows=args.windows,
    )
    width = replay.duration / args.windows
    start = args.trace_window[0] if args.trace_window else 0.0
    minutes = width * args.compress / 60
    description = (
        f"{' + '.join(names)} merged by time, "
        + (f"minutes {start:g}-{args.trace_window[1]:g}" if args.trace_window else "all")
        + f" of the trace (from its first request), compressed {args.compress:g}x, "
        f"{args.keep:.0%} of the requests kept at random (seed {args.seed}): "
        f"{len(replay.requests)} requests over {replay.duration:.0f} modeled s, "
        f"{args.windows} windows of {width:.0f} s (W1 = trace minutes "
        f"{start:g}-{start + minutes:g})"
    )
    return Workload(
        replay.requests,
        replay.duration,
        [f"W{i + 1}" for i in range(args.windows)],
        description,
        [(i * width, (i + 1) * width) for i in range(1, args.windows, 2)],
        "every other window",
        TRACE_GOAL_RATIO,
        goodput_per_window=True,
    )


def scaled_workload(work: Workload, factor: int, seed: int) -> Workload:
    """``work`` with every request sent ``factor`` times, as bench/fleet_sim.py's
    ``--load-scale`` sends it (the same copies for the same seed), counted in its windows
    again: a fleet of N workers gets the load the trace was thinned for at four, N/4 times."""
    if factor <= 1:
        return work
    from fleet_sim import scale_load  # fleet_sim imports this module, so not at its top

    trace = in_windows(scale_load(work.trace, factor, seed), len(work.heads), work.duration)
    return replace(
        work,
        trace=trace,
        description=f"{work.description}; each request {factor} times ({len(trace)} requests)",
    )


# --- outcomes and goodput -------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    """Service level objectives in modeled seconds."""

    ttft_secs: float = 2.0
    tpot_secs: float = 0.030


@dataclass(frozen=True)
class Outcome:
    """What the client saw of one request (modeled seconds); ``error`` set when it failed."""

    request: TraceRequest
    ttft: float | None = None
    tpot: float | None = None
    error: str | None = None


def meets_slo(outcome: Outcome, slo: Slo) -> bool:
    """Finished without error, first token within the TTFT SLO, every later one (on average)
    within the TPOT SLO; a one-token answer has no TPOT to miss."""
    if outcome.error is not None or outcome.ttft is None or outcome.ttft > slo.ttft_secs:
        return False
    return outcome.tpot is None or outcome.tpot <= slo.tpot_secs


def goodput(outcomes: Sequence[Outcome], slo: Slo, duration: float) -> float:
    """Requests per second (modeled) that met both SLOs, over ``duration``."""
    return sum(meets_slo(o, slo) for o in outcomes) / duration


def _tally(outcomes: Sequence[Outcome], slo: Slo, count: int) -> tuple[list[int], list[int]]:
    """Per phase, how many requests were sent in it and how many of those met both SLOs."""
    sent = [0] * count
    good = [0] * count
    for outcome in outcomes:
        sent[outcome.request.phase] += 1
        good[outcome.request.phase] += meets_slo(outcome, slo)
    return sent, good


def attainment_by_phase(outcomes: Sequence[Outcome], slo: Slo, count: int) -> list[float]:
    """Per phase, the share of the requests sent in it that met both SLOs (nan when none)."""
    sent, good = _tally(outcomes, slo, count)
    return [g / s if s else math.nan for g, s in zip(good, sent, strict=True)]


def goodput_by_phase(
    outcomes: Sequence[Outcome], slo: Slo, count: int, phase_secs: float
) -> list[float]:
    """Per phase (or window) of ``phase_secs``, the requests sent in it that met both SLOs,
    per second."""
    return [g / phase_secs for g in _tally(outcomes, slo, count)[1]]


def goodput_series(
    outcomes: Sequence[Outcome], slo: Slo, duration: float, bin_secs: float
) -> list[float]:
    """Goodput per bin of ``bin_secs``, each request counted in the bin it was sent in."""
    bins = [0] * math.ceil(duration / bin_secs)
    for outcome in outcomes:
        if meets_slo(outcome, slo):
            bins[min(int(outcome.request.at // bin_secs), len(bins) - 1)] += 1
    return [n / bin_secs for n in bins]


# --- configurations -------------------------------------------------------------------------


@dataclass(frozen=True)
class Configuration:
    name: str
    prefill: int
    decode: int
    router_toml: str = ""
    switch_secs: float | None = None

    @property
    def autopilot(self) -> bool:
        return bool(self.router_toml)


# The donor's peak horizon (modeled s): a sixth of the synthetic trace's 60 s phases, three
# minutes of a real trace compressed 6x (docs/PERFORMANCE.md, "The donor's peak over three
# minutes of trace": a minute there let single bursts decide; 30 s on the synthetic phases
# carried the last phase's need through half of the next, 0.91x of the best static split).
SYNTHETIC_PEAK_SECS = 10.0
TRACE_PEAK_SECS = 30.0


def default_autopilot(speed: float, slo: Slo, peak_secs: float) -> str:
    """``[autopilot]`` in mode auto with the benchmark's SLOs, its sampling, window, sustain,
    cooldown, peak horizon and flip guard scaled like the trace (1, 3, 1.5, 2, ``peak_secs``
    and 60 modeled seconds: a phase of a minute must be met within seconds; production phases
    last longer and take the defaults): the router measures wall time, so every duration it
    is given is a modeled one times ``speed``."""
    keys = {
        "interval_secs": 1 * speed,
        "window_secs": 3 * speed,
        "sustain_secs": 1.5 * speed,
        "cooldown_secs": 2 * speed,
        "peak_secs": peak_secs * speed,
        "flip_guard_secs": 60 * speed,
        "ttft_slo_ms": slo.ttft_secs * 1000 * speed,
        "tpot_slo_ms": slo.tpot_secs * 1000 * speed,
    }
    return '[autopilot]\nmode = "auto"\n' + "".join(f"{k} = {v:g}\n" for k, v in keys.items())


def default_splits(workers: int) -> list[int]:
    """The prefill counts of the static splits: a quarter, half and three quarters of the
    fleet (1P3D, 2P2D, 3P1D at four workers)."""
    return sorted({max(1, workers // 4), workers // 2, min(workers - 1, 3 * workers // 4)})


def configurations(
    autopilot_toml: str, restart_secs: float, workers: int = 4, splits: Sequence[int] = ()
) -> list[Configuration]:
    """A static configuration per prefill count of ``splits`` (default_splits when empty),
    then the autopilot and autopilot-restart, both from the middle split."""
    middle = workers // 2
    return [
        *(
            Configuration(f"static {p}P{workers - p}D", p, workers - p)
            for p in splits or default_splits(workers)
        ),
        Configuration("autopilot", middle, workers - middle, autopilot_toml),
        Configuration("autopilot-restart", middle, workers - middle, autopilot_toml, restart_secs),
    ]


def refusal(extra: str) -> str | None:
    """Why the router would refuse ``extra`` (its own config validation), or None."""
    text = router_toml(
        1, {"http://127.0.0.1:2": 3}, ["http://127.0.0.1:4"],
        drain_timeout_secs=DRAIN_TIMEOUT_SECS, extra=extra,
    )  # fmt: skip
    try:
        build_config(tomllib.loads(text))
    except (ConfigError, tomllib.TOMLDecodeError) as exc:
        return str(exc)
    return None


# --- replay ---------------------------------------------------------------------------------


@dataclass
class Run:
    """What one configuration produced."""

    config: Configuration
    outcomes: list[Outcome] = field(default_factory=list)
    pools: list[tuple[float, int, int]] = field(default_factory=list)
    conversions: int = 0
    failed_conversions: int = 0
    # Conversions still draining or switching when the trace's last request ended.
    unfinished_conversions: int = 0
    wall_secs: float = 0.0
    # Autopilot configurations: (modeled time, GET /autopilot "loads") once a modeled second,
    # and the conversions it decided with their reasons.
    loads: list[tuple[float, dict]] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    conversion_records: list[dict] = field(default_factory=list)


def prompt_ids(request: TraceRequest) -> list[int]:
    """Token ids of the request's prompt, its own: seeded by the request's send time, so no
    two prompts share a prefix and the workers' prefix cache saves no prefill (the trace
    measures the split of the pools, not cache hits)."""
    return random.Random(request.at).choices(TOKEN_IDS, k=request.prompt_tokens)


async def send(
    session: aiohttp.ClientSession, url: str, request: TraceRequest, speed: float
) -> Outcome:
    """Stream one request; TTFT from sending to the first token, TPOT over the rest."""
    body = {
        "input_ids": prompt_ids(request),
        "sampling_params": {"max_new_tokens": request.output_tokens, "ignore_eos": True},
        "stream": True,
    }
    sent = time.monotonic()
    first = last = None
    try:
        async with session.post(url + "/generate", data=orjson.dumps(body)) as response:
            if response.status != 200:
                return Outcome(request, error=f"HTTP {response.status}")
            async for line in response.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return finished(request, sent, first, last, speed)
                if "error" in orjson.loads(payload):
                    return Outcome(request, error=payload[:200].decode(errors="replace"))
                last = time.monotonic()
                first = first or last
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome(request, error=f"{type(exc).__name__}: {exc}")
    return Outcome(request, error="stream ended without [DONE]")


def finished(
    request: TraceRequest, sent: float, first: float | None, last: float | None, speed: float
) -> Outcome:
    if first is None or last is None:
        return Outcome(request, error="no token before [DONE]")
    tpot = None
    if request.output_tokens > 1:
        tpot = (last - first) / (request.output_tokens - 1) / speed
    return Outcome(request, ttft=(first - sent) / speed, tpot=tpot)


async def sample_pools(
    session: aiohttp.ClientSession, url: str, run: Run, began: float, speed: float
) -> None:
    """Record (modeled time, ACTIVE prefills, ACTIVE decodes) once a modeled second, and the
    autopilot's view of the pools when it runs."""
    while True:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/workers") as response:
                workers = (await response.json())["workers"]
            active = [w["role"] for w in workers if w["state"] == "active"]
            now = (time.monotonic() - began) / speed
            run.pools.append((now, active.count("prefill"), active.count("decode")))
            if run.config.autopilot:
                async with session.get(url + "/autopilot") as response:
                    run.loads.append((now, (await response.json())["loads"]))
        await asyncio.sleep(speed)


async def replay(url: str, trace: list[TraceRequest], speed: float, run: Run) -> None:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=REQUEST_READ_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        began = time.monotonic()
        sampler = asyncio.create_task(sample_pools(session, url, run, began, speed))
        tasks = []
        for request in trace:
            delay = began + request.at * speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, url, request, speed)))
        run.outcomes = list(await asyncio.gather(*tasks))
        run.wall_secs = time.monotonic() - began
        sampler.cancel()
        async with session.get(url + "/conversions?limit=10000") as response:
            records = (await response.json())["conversions"]
        if run.config.autopilot:
            async with session.get(url + "/autopilot") as response:
                run.decisions = (await response.json())["decisions"]
    run.conversion_records = records
    run.conversions = sum(r["status"] == "succeeded" for r in records)
    run.unfinished_conversions = sum(r["status"] not in FINAL for r in records)
    run.failed_conversions = len(records) - run.conversions - run.unfinished_conversions


def run_configuration(
    config: Configuration, trace: list[TraceRequest], args: argparse.Namespace, log_dir: Path
) -> Run:
    knobs: dict[str, float] = {
        "max_running_requests": args.decode_batch_cap,
        "bootstrap_timeout_secs": WORKER_WAIT_SECS,
        "room_timeout_secs": WORKER_WAIT_SECS,
    }
    if config.switch_secs is not None:
        knobs["switch_secs"] = config.switch_secs
    run = Run(config)
    log_path = log_dir / f"router-{config.name.replace(' ', '-')}.log"
    with (
        WorkerCluster(
            config.prefill, config.decode, speed=args.speed, profile=PROFILE, **knobs
        ) as cluster,
        running_router(
            cluster,
            drain_timeout_secs=DRAIN_TIMEOUT_SECS,
            extra=config.router_toml,
            log_path=log_path,
        ) as url,  # fmt: skip
    ):
        asyncio.run(replay(url, trace, args.speed, run))
    if config.autopilot:
        trail = {
            "decisions": run.decisions,
            "conversions": run.conversion_records,
            "loads": run.loads,
        }
        log_path.with_suffix(".autopilot.json").write_bytes(
            orjson.dumps(trail, option=orjson.OPT_INDENT_2)
        )
    return run


# --- report ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latency_columns(outcomes: Sequence[Outcome]) -> str:
    """The report's TTFT and TPOT p50/p90 columns, in ms."""
    ttft = [o.ttft for o in outcomes if o.ttft is not None]
    tpot = [o.tpot for o in outcomes if o.tpot is not None]
    return (
        f"{_ms(percentile(ttft, 50))}/{_ms(percentile(ttft, 90))} | "
        f"{_ms(percentile(tpot, 50))}/{_ms(percentile(tpot, 90))}"
    )


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.0f}"


def _ratio(value: float, best: float) -> str:
    """``value`` against the best static split (which a run of --only autopilot lacks)."""
    return "-" if math.isnan(best) or best == 0 else f"{value / best:.2f}x"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.0f}%"


def report(
    runs: list[Run], skipped: list[str], work: Workload, slo: Slo, args: argparse.Namespace
) -> str:
    duration = work.duration
    static = [goodput(r.outcomes, slo, duration) for r in runs if not r.config.autopilot]
    best = max(static, default=math.nan)
    heads = " | ".join(work.heads)
    lines = [
        f"# Rebalancing benchmark ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `{' '.join(sys.argv)}`",
        "",
        f"- Cluster: {args.workers} pd_worker processes, profile `{PROFILE}`, speed {args.speed} "
        f"(1 modeled s = {args.speed} s wall), decode batch cap {args.decode_batch_cap} "
        "running requests per worker.",
        f"- Trace: {work.description}",
        f"- SLOs: TTFT <= {slo.ttft_secs * 1000:.0f} ms, TPOT <= {slo.tpot_secs * 1000:.0f} ms "
        "(modeled); goodput = requests meeting both / trace duration.",
        "",
        f"| configuration | goodput (req/s) | vs best static | {heads} | TTFT p50/p90 ms "
        "| TPOT p50/p90 ms | conversions | failed requests | wall s |",
        "|---|---|---|" + "---|" * len(work.heads) + "---|---|---|---|---|",
    ]
    for run in runs:
        value = goodput(run.outcomes, slo, duration)
        shares = attainment_by_phase(run.outcomes, slo, len(work.heads))
        failed = sum(o.error is not None for o in run.outcomes)
        latency = latency_columns(run.outcomes)
        conversions = f"{run.conversions}"
        if run.failed_conversions:
            conversions += f" (+{run.failed_conversions} failed)"
        if run.unfinished_conversions:
            conversions += f" (+{run.unfinished_conversions} unfinished at the end)"
        lines.append(
            f"| {run.config.name} | {value:.2f} | {_ratio(value, best)} | "
            + " | ".join(_pct(s) for s in shares)
            + f" | {latency} | {conversions} | {failed} | {run.wall_secs:.0f} |"
        )
    if work.goodput_per_window:
        lines += window_goodput_lines(runs, work, slo)
    lines += goal_lines(runs, work, slo)
    if args.simulate:
        lines += simulated_lines(runs, work, slo, args)
    lines += ["", *(f"Skipped: {reason}" for reason in skipped)]
    errors = [o.error for r in runs for o in r.outcomes if o.error][:5]
    if errors:
        lines += ["", "First errors:", *(f"- {e}" for e in errors)]
    return "\n".join(lines) + "\n"


def window_goodput_lines(runs: list[Run], work: Workload, slo: Slo) -> list[str]:
    """A table of each configuration's goodput (req/s within both SLOs) per window."""
    count = len(work.heads)
    lines = [
        "",
        "Goodput per window (req/s sent in the window that met both SLOs):",
        "",
        "| configuration | " + " | ".join(work.heads) + " |",
        "|---|" + "---|" * count,
    ]
    for run in runs:
        values = goodput_by_phase(run.outcomes, slo, count, work.duration / count)
        lines.append(f"| {run.config.name} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return lines


def simulated_lines(
    runs: list[Run], work: Workload, slo: Slo, args: argparse.Namespace
) -> list[str]:
    """The fleet simulator (bench/fleet_sim.py) on each configuration that ran, on the same
    requests, split, decode batch cap and switch time, with the autopilot converting one
    server at a time as the router here does: a table of real against simulated goodput
    (issue 30 asks them within 10% at 4-16 workers). The simulated autopilot takes the
    default ``[autopilot]`` section, whatever --autopilot-config says."""
    import fleet_sim  # it imports this module, so not at its top

    lines = [
        "",
        "Real against simulated (bench/fleet_sim.py on the same requests):",
        "",
        "| configuration | real goodput | simulated | difference | real conversions "
        "| simulated conversions | failed real / simulated | simulation CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        config = run.config
        knobs: dict[str, float] = {"max_running_requests": args.decode_batch_cap}
        if config.switch_secs is not None:
            knobs["switch_secs"] = config.switch_secs
        setup = fleet_sim.Setup(config.name, config.prefill, config.decode, config.autopilot)
        sim = fleet_sim.simulate(setup, work.trace, profile(PROFILE, **knobs), work, slo, args.seed)
        real = goodput(run.outcomes, slo, work.duration)
        difference = f"{sim.goodput / real - 1:+.1%}" if real > 0 else "-"
        failed = sum(o.error is not None for o in run.outcomes)
        lines.append(
            f"| {config.name} | {real:.2f} | {sim.goodput:.2f} | {difference} | "
            f"{run.conversions} | {fleet_sim.conversion_text(sim.result)} | "
            f"{failed} / {sim.failed} | {sim.cpu_secs:.1f} |"
        )
    return lines


GOAL_RATIO = 1.3
PHASE_FLOOR = 0.9


def goal_lines(runs: list[Run], work: Workload, slo: Slo) -> list[str]:
    """The issue's goal checked for the in-place autopilot against the best static split (by
    goodput over the trace): at least ``work.goal_ratio`` times its goodput, in every phase at
    least ``PHASE_FLOOR`` times its SLO attainment, and no failed request."""
    static = [r for r in runs if not r.config.autopilot]
    pilot = next((r for r in runs if r.config.name == "autopilot"), None)
    if not static or pilot is None:
        return []
    best = max(static, key=lambda r: goodput(r.outcomes, slo, work.duration))
    ratio = goodput(pilot.outcomes, slo, work.duration) / max(
        goodput(best.outcomes, slo, work.duration), 1e-9
    )
    mine = attainment_by_phase(pilot.outcomes, slo, len(work.heads))
    theirs = attainment_by_phase(best.outcomes, slo, len(work.heads))
    short = [
        f"{head} {_pct(a)} vs {_pct(b)}"
        for head, a, b in zip(work.heads, mine, theirs, strict=True)
        if a < PHASE_FLOOR * b
    ]
    failed = sum(o.error is not None for o in pilot.outcomes)
    verdict = ratio >= work.goal_ratio and not short and failed == 0
    return [
        "",
        f"Goal against the best static split ({best.config.name}): "
        + ("met" if verdict else "NOT met"),
        f"- goodput {ratio:.2f}x (goal >= {work.goal_ratio}x)",
        f"- phases below {PHASE_FLOOR:.0%} of its attainment: "
        + (", ".join(short) if short else "none"),
        f"- failed requests: {failed}",
    ]


def plot(
    runs: list[Run], work: Workload, slo: Slo, path: Path, bin_secs: float, workers: int
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for start, end in work.shaded:
        for axis in (top, bottom):
            axis.axvspan(start, end, color="0.92", lw=0)
    for run in runs:
        series = goodput_series(run.outcomes, slo, work.duration, bin_secs)
        times = [bin_secs * (i + 0.5) for i in range(len(series))]
        top.plot(times, series, marker=".", label=run.config.name)
        if run.pools:
            bottom.step([p[0] for p in run.pools], [p[1] for p in run.pools], where="post")
    top.set_ylabel("goodput (req/s)")
    top.set_title(f"Goodput and prefill pool size (grey: {work.shading})")
    top.legend(fontsize="small", ncol=3)
    bottom.set_ylabel(f"ACTIVE prefills (of {workers})")
    bottom.set_xlabel("modeled time (s)")
    bottom.set_ylim(0, workers + 0.2)
    bottom.set_xlim(0, work.duration)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# --- main -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", type=float, default=0.35, help="wall s per modeled s")
    parser.add_argument("--phases", type=int, default=6)
    parser.add_argument("--phase-secs", type=float, default=60.0, help="modeled seconds")
    parser.add_argument("--load", type=float, default=1.0, help="multiplies every arrival rate")
    parser.add_argument(
        "--seed", type=int, default=10, help="the synthetic trace's, or --keep's thinning"
    )
    parser.add_argument("--decode-batch-cap", type=int, default=4)
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-ms", type=float, default=30.0)
    parser.add_argument("--restart-secs", type=float, default=60.0, help="modeled switch time")
    parser.add_argument(
        "--autopilot-config",
        type=Path,
        default=None,
        help="TOML fragment appended to the router config of the autopilot configurations "
        "(default: [autopilot] mode auto with the SLOs and reaction times scaled by --speed)",
    )
    parser.add_argument(
        "--only",
        default=None,
        help='"static", "autopilot", or configuration names separated by commas '
        '("static 2P2D,autopilot")',
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="replay real traces instead of the synthetic one: names "
        f"({', '.join(KNOWN)}) or CSV paths, separated by commas, merged by time",
    )
    parser.add_argument(
        "--trace-window",
        type=minute_range,
        default=None,
        metavar="START:END",
        help="minutes of the trace to replay, from its first request (default: all)",
    )
    parser.add_argument(
        "--compress", type=float, default=None, help="play the trace this many times faster"
    )
    parser.add_argument(
        "--keep", type=float, default=None, help="share of the trace's requests kept, seeded"
    )
    parser.add_argument(
        "--windows", type=int, default=None, help="equal windows the trace is reported in (6)"
    )
    parser.add_argument("--workers", type=int, default=4, help="pd_worker processes (>= 2)")
    parser.add_argument(
        "--splits",
        type=prefill_counts,
        default=(),
        metavar="P,P,...",
        help="prefill counts of the static splits (default: N/4, N/2, 3N/4)",
    )
    parser.add_argument(
        "--load-scale",
        type=int,
        default=None,
        help="send each request of the trace this many times (bench/fleet_sim.py's copies)",
    )
    parser.add_argument(
        "--scale-load", action="store_true", help="--load-scale workers/4 (with --trace)"
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="also run the fleet simulator on each configuration and report real vs simulated",
    )
    parser.add_argument("--bin-secs", type=float, default=10.0, help="plot bin, modeled s")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"default {PLOT.relative_to(REPO)}; with --trace, next to the report",
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.speed <= 0 or args.phases < 1 or args.phase_secs <= 0 or args.load <= 0:
        parser.error("--speed, --phases, --phase-secs and --load must be > 0")
    trace_options = (args.trace_window, args.compress, args.keep, args.windows, args.load_scale)
    if args.trace is None and (args.scale_load or any(o is not None for o in trace_options)):
        parser.error(
            "--trace-window, --compress, --keep, --windows, --load-scale and --scale-load "
            "apply to --trace only"
        )
    if args.workers < 2 or not all(0 < p < args.workers for p in args.splits):
        parser.error("--workers must be >= 2 and every split leave a prefill and a decode")
    if args.load_scale is not None and args.load_scale < 1:
        parser.error("--load-scale must be >= 1")
    args.load_scale = max(1, args.workers // 4) if args.scale_load else (args.load_scale or 1)
    args.compress = 1.0 if args.compress is None else args.compress
    args.keep = 1.0 if args.keep is None else args.keep
    args.windows = 6 if args.windows is None else args.windows
    return args


def prefill_counts(text: str) -> tuple[int, ...]:
    """``P,P,...`` prefill counts (argparse's type for --splits)."""
    try:
        return tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not prefill counts P,P,...") from None


def minute_range(text: str) -> tuple[float, float]:
    """``START:END`` minutes, START before END (argparse's type for --trace-window)."""
    start, _, end = text.partition(":")
    bad = argparse.ArgumentTypeError(f"{text!r} is not START:END minutes, 0 <= START < END")
    try:
        minutes = (float(start), float(end))
    except ValueError:
        raise bad from None
    if not 0 <= minutes[0] < minutes[1]:
        raise bad
    return minutes


def selected(config: Configuration, only: str | None) -> bool:
    """Whether ``--only`` (a family, "static" or "autopilot", or names) includes ``config``."""
    if only is None:
        return True
    if only in ("static", "autopilot"):
        return (only == "autopilot") == config.autopilot
    return config.name in {name.strip() for name in only.split(",")}


def matplotlib_missing() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.no_plot and matplotlib_missing():
        print(
            "rebalance: matplotlib is missing; install it with "
            "`.venv/bin/pip install -e '.[bench]'` or pass --no-plot",
            file=sys.stderr,
        )
        return 2
    try:
        work = (
            scaled_workload(trace_workload(args), args.load_scale, args.seed)
            if args.trace
            else synthetic_workload(TraceSpec(args.seed, args.phases, args.phase_secs, args.load))
        )
    except TraceError as exc:
        print(f"rebalance: {exc}", file=sys.stderr)
        return 2
    slo = Slo(args.ttft_ms / 1000, args.tpot_ms / 1000)
    autopilot_toml = (
        args.autopilot_config.read_text()
        if args.autopilot_config
        else default_autopilot(
            args.speed, slo, TRACE_PEAK_SECS if args.trace else SYNTHETIC_PEAK_SECS
        )
    )
    trace = work.trace
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    log_dir = args.results_dir / f"rebalance-{stamp}"
    written = args.results_dir / f"rebalance-{stamp}.md"
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    skipped: list[str] = []
    for config in configurations(autopilot_toml, args.restart_secs, args.workers, args.splits):
        if not selected(config, args.only):
            continue
        reason = refusal(config.router_toml) if config.autopilot else None
        if reason is not None:
            skipped.append(f"{config.name}: the router refuses the autopilot config ({reason})")
            print(f"rebalance: skipping {skipped[-1]}", file=sys.stderr)
            continue
        print(f"rebalance: {config.name} ({len(trace)} requests)", file=sys.stderr, flush=True)
        runs.append(run_configuration(config, trace, args, log_dir))
        # The report so far after every configuration: a run cut short keeps what it measured.
        text = report(runs, skipped, work, slo, args)
        written.write_text(text)
    text = report(runs, skipped, work, slo, args)
    written.write_text(text)
    print(text)
    print(f"rebalance: report written to {written}", file=sys.stderr)
    if not args.no_plot and runs:
        path = args.plot or (written.with_suffix(".png") if args.trace else PLOT)
        plot(runs, work, slo, path, args.bin_secs, args.workers)
        print(f"rebalance: plot written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
