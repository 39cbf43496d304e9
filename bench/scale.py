"""Scaling across cores: pd-router ``--workers 1,2,4,6`` against smg on the same backends.

One run starts 2P2D stub workers (bench/stub_worker.py, several processes per worker sharing
its port), then every router setup of ``--setups`` at once, each on the same router cores, and
drives each in turn with closed-loop load at every ``--concurrency``, streaming and not
(interleaved rounds, rotating order). The machine's cores are split three ways and pinned with
``taskset``: the routers' cores (``--router-cores``, the highest-numbered), the workers' and
the load generators', so the three never share a core (with only one core left beside the
router's, the workers and generators share it; the report says so). ``--share-cores`` pins
nothing instead: a small box where the router runs beside its load and the scheduler decides.
The load comes from several bench/loadgen.py processes, one per generator core, sharing one
measurement window.

Setups: ``smg`` (``smg launch --pd-disaggregation ... --policy round_robin``, its tokio threads
one per router core), ``N`` (one pd-router with ``--workers N``; ``1`` passes the flag only to a
pd-router that knows it), ``Ns`` (N separate pd-router processes on N ports,
the clients spread over them: what N processes give without a shared view). Two more tell how
far this machine lets anything scale: ``smgK`` (smg pinned to K of the router cores, its tokio
threads one per core: ``smg1`` against ``smg`` is the peer's own scaling) and ``1busy`` (one
pd-router process on the first router core while bare Python loops keep the other router cores
busy, as the many-process setups do: a virtual machine's cores may run slower when their
neighbours work).

Reported per concurrency, mode and setup: req/s, p50/p99 latency, errors, router CPU per
request and in cores busy, the workers' and the generators' cores busy (and the busiest
generator's share of its core), so a saturated backend or generator cannot pass for a slow
router; ratios to smg and to N times one process; the goals of issue 17.

    .venv/bin/python bench/scale.py                              # every core this process may use
    .venv/bin/python bench/scale.py --setups smg,1,2 --concurrency 64 --rounds 1
    .venv/bin/python bench/scale.py --profile 10                 # + py-spy one data plane
    .venv/bin/python bench/scale.py --share-cores --setups smg,1,2 --loadgens 1   # small box

``--profile N`` py-spies for N seconds one data-plane process of the largest ``--workers``
setup (or one of the separate processes) under non-streaming load at the highest concurrency,
and converts the sample shares into microseconds of that process's CPU per request. Results go
to stdout and bench/results/scale-<timestamp>.md (raw stacks and router logs in
bench/results/scale-<timestamp>/). Exit status 1 if pd-router had an error or did not start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import orjson
from overhead import (
    HOST,
    MODES,
    RESULTS,
    BenchConfig,
    Figures,
    RouterProcess,
    RouterStartError,
    backend_topology,
    loadgen_argv,
    percentile,
    repo_revision,
    running_router,
    shown,
)
from peers import (
    PEERS,
    REPO,
    Peer,
    PeerSetupError,
    check_peer,
    ensure_peer,
    ensure_py_spy,
    free_port,
)
from proc_cpu import cpu_seconds, pinned, process_tree
from profile_summary import markdown as profile_markdown
from profile_summary import summarize
from stub_worker import stub_cluster

LOADGEN_START_S = 2.0
SEGMENT_SLACK_S = 120.0
PROFILE_PICK_S = 1.0
SMG = "smg"
BUSY_NEIGHBOURS = "1busy"
BASELINE = "base"
SPIN_FOREVER = "while True: pass"


@dataclass(frozen=True)
class CorePlan:
    """Which cores the routers, the stub workers and the load generators may use."""

    router: tuple[int, ...]
    backends: tuple[int, ...]
    loadgens: tuple[int, ...]

    @property
    def shared(self) -> bool:
        """Workers and generators on the same cores (too few cores to keep them apart)."""
        return bool(set(self.backends) & set(self.loadgens))

    @property
    def router_shared(self) -> bool:
        """The routers on the workers' cores too: no core is the router's own."""
        return bool(set(self.router) & set(self.backends))

    def describe(self) -> str:
        def cores(cpus: tuple[int, ...]) -> str:
            return f"{len(cpus)} core{'s' if len(cpus) > 1 else ''} ({cpu_list(cpus)})"

        if self.router_shared:
            return f"routers, workers and load generators sharing {cores(self.router)}, unpinned"
        text = f"routers on {cores(self.router)}, "
        if self.shared:
            return text + f"workers and load generators sharing {cores(self.backends)}"
        return (
            text + f"workers on {cores(self.backends)}, load generators on {cores(self.loadgens)}"
        )


def cpu_list(cpus: Sequence[int]) -> str:
    return ",".join(str(cpu) for cpu in cpus)


def plan_cores(available: Sequence[int], router: int, backends: int | None = None) -> CorePlan:
    """The routers get the ``router`` highest-numbered cores; the rest go to the workers
    (``backends`` of them, default half rounded up) and the generators. One core left: the
    workers and generators share it."""
    cores = sorted(set(available))
    if not 1 <= router < len(cores):
        raise ValueError(f"need 1 <= router cores < {len(cores)} (the cores available)")
    rest = cores[:-router]
    if len(rest) == 1:
        return CorePlan(tuple(cores[-router:]), tuple(rest), tuple(rest))
    count = (len(rest) + 1) // 2 if backends is None else backends
    if not 1 <= count < len(rest):
        raise ValueError(f"need 1 <= backend cores < {len(rest)} (the cores left)")
    return CorePlan(tuple(cores[-router:]), tuple(rest[:count]), tuple(rest[count:]))


def shared_plan(available: Sequence[int]) -> CorePlan:
    """Every part on every core, as on a small box where the router runs beside its load: the
    scheduler, not taskset, decides who runs where."""
    cores = tuple(sorted(set(available)))
    return CorePlan(cores, cores, cores)


def default_router_cores(available: int) -> int:
    """Six router cores where 16 or more are available (the issue's setting), else a third of
    them, at least one."""
    return 6 if available >= 16 else max(1, available // 3)


@dataclass(frozen=True)
class Setup:
    """One router setup: smg (on every router core, or on ``count`` of them), one pd-router
    with ``--workers N``, or N separate pd-routers. ``busy_neighbours``: one pd-router process
    on one router core while bare loops keep the other router cores busy, so that it runs on a
    machine as loaded as the many-process setups leave it. ``venv``: a pd-router setup run
    from another build (``--baseline``), to compare two versions of the router in one run."""

    kind: str  # "smg", "workers" or "separate"
    count: int = 1  # smg: router cores it is pinned to, 0 for all of them
    busy_neighbours: bool = False
    venv: Path | None = None

    @property
    def name(self) -> str:
        if self.kind == SMG:
            cores = f" on {self.count} core{'s' if self.count > 1 else ''}" if self.count else ""
            return SMG + cores
        if self.busy_neighbours:
            return f"pd-router --workers {self.count}, other router cores busy"
        if self.kind == "workers":
            build = " (baseline)" if self.venv else ""
            return f"pd-router --workers {self.count}{build}"
        return f"{self.count} pd-router processes"

    def cores(self, router: Sequence[int]) -> tuple[int, ...]:
        """The router cores this setup's processes are pinned to."""
        if self.busy_neighbours or (self.kind == SMG and self.count):
            return tuple(router[: self.count])
        return tuple(router)

    def spun(self, router: Sequence[int]) -> tuple[int, ...]:
        """The router cores that bare loops keep busy while this setup is measured."""
        return tuple(router[self.count :]) if self.busy_neighbours else ()

    def multiple(self, router: Sequence[int]) -> int:
        """How many times its family's one-core figure this setup should reach: the data-plane
        processes of a pd-router setup, the cores of an smg one."""
        return len(self.cores(router)) if self.kind == SMG else self.count


SMG_ONE_CORE = Setup(SMG, 1)
BUSY_ONE = Setup("workers", 1, busy_neighbours=True)


def parse_setups(text: str, baseline: Path | None = None) -> tuple[Setup, ...]:
    """``"smg,smg1,1,1busy,2,6s,1base"`` -> smg, smg on 1 core, --workers 1, --workers 1 beside
    busy router cores, --workers 2, 6 separate processes, --workers 1 of the baseline build."""
    setups = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry.endswith(BASELINE):
            if baseline is None:
                raise ValueError(f"{entry}: a baseline setup needs --baseline VENV")
            setups.append(Setup("workers", int(entry.removesuffix(BASELINE)), venv=baseline))
            continue
        if entry.startswith(SMG):
            setups.append(Setup(SMG, int(entry.removeprefix(SMG) or 0)))
            continue
        if entry == BUSY_NEIGHBOURS:
            setups.append(BUSY_ONE)
            continue
        separate = entry.endswith("s")
        count = int(entry.removesuffix("s"))
        if not 1 <= count <= 64:
            raise ValueError(f"{entry}: process counts must be between 1 and 64")
        setups.append(Setup("separate" if separate else "workers", count))
    if not setups:
        raise ValueError("no setup named")
    return tuple(dict.fromkeys(setups))


def split_concurrency(total: int, generators: int) -> list[int]:
    """Clients per generator process: as even as possible, none left empty."""
    generators = max(1, min(generators, total))
    base, extra = divmod(total, generators)
    return [base + (1 if i < extra else 0) for i in range(generators)]


def rotated(urls: Sequence[str], offset: int) -> list[str]:
    """urls starting at offset (mod their number): a generator whose first client is the
    offset-th of the run sends client k to url k mod len(urls), as one generator would."""
    shift = offset % len(urls)
    return [*urls[shift:], *urls[:shift]]


def merge_segments(parts: Sequence[Mapping]) -> dict:
    """The results of the generators of one segment as one loadgen result. Router and worker
    CPU come from the first generator (the only one that reads them); ``loadgen_peak`` is the
    busiest generator's CPU in cores."""
    first = parts[0]
    samples = [sample for part in parts for sample in part["error_samples"]]
    return {
        "completed": sum(part["completed"] for part in parts),
        "errors": sum(part["errors"] for part in parts),
        "error_samples": samples[:5],
        "window_s": first["window_s"],
        "latencies_ms": [v for part in parts for v in part["latencies_ms"]],
        "ttft_ms": [v for part in parts for v in part["ttft_ms"]],
        "router_cpu_s": first["router_cpu_s"],
        "backend_cpu_s": first["backend_cpu_s"],
        "loadgen_cpu_s": sum(part["loadgen_cpu_s"] for part in parts),
        "loadgen_peak": max(part["loadgen_cpu_s"] / part["window_s"] for part in parts),
    }


@dataclass
class Cell:
    """Sums over the rounds of one (setup, concurrency, mode)."""

    figures: Figures = field(default_factory=Figures)
    loadgen_peak: float = 0.0

    def add(self, segment: dict) -> None:
        self.figures.add(segment)
        self.loadgen_peak = max(self.loadgen_peak, segment["loadgen_peak"])


Key = tuple[str, int, str]  # (setup name, concurrency, mode)


@dataclass(frozen=True)
class ScaleConfig:
    """What one run measures and where; printed with the results."""

    load: BenchConfig  # modes, warm-up, duration, rounds, tokens, 2P2D, results dir
    setups: tuple[Setup, ...]
    concurrencies: tuple[int, ...]
    plan: CorePlan
    backend_processes: int
    loadgens: int
    client: str = "fast"


def setup_peers(setup: Setup, cores: Sequence[int], workers_flag: bool = True) -> list[Peer]:
    """The routers of one setup, each pinned to the router cores, each with its own name;
    ``--workers N`` is passed for N > 1, and for N = 1 where the pd-router knows the flag."""
    base = PEERS[SMG] if setup.kind == SMG else PEERS["pd-router"]
    if setup.venv is not None:
        base = dataclasses.replace(base, venv_name=str(setup.venv.resolve()))
    explicit = setup.kind == "workers" and (setup.count > 1 or workers_flag)
    extra = ["--workers", str(setup.count)] if explicit else []

    def build(bin_dir: Path, topology, host: str, port: int) -> list[str]:
        argv = [*base.build_argv(bin_dir, topology, host, port), *extra]
        return pinned(argv, setup.cores(cores))

    copies = setup.count if setup.kind == "separate" else 1
    slug = setup.name.replace(" ", "").replace("--", "-").replace("(", "-").replace(")", "")
    return [
        dataclasses.replace(
            base, name=slug if copies == 1 else f"{slug}-{i}", build_argv=build, description=""
        )
        for i in range(copies)
    ]


def pd_router_has_workers_flag() -> bool:
    """Whether the installed pd-router knows ``--workers`` (issue 17's multi-process mode)."""
    exe = PEERS["pd-router"].venv / "bin" / "pd-router"
    done = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=False)
    return "--workers" in done.stdout


@contextlib.contextmanager
def busy_cores(cores: Sequence[int]) -> Iterator[list[subprocess.Popen]]:
    """A bare Python loop on each of ``cores`` for the duration of the block."""
    spinners = [
        subprocess.Popen(pinned([sys.executable, "-c", SPIN_FOREVER], [core])) for core in cores
    ]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run_segment(
    routers: Sequence[RouterProcess],
    cfg: ScaleConfig,
    concurrency: int,
    stream: bool,
    backend_pids: Sequence[int],
    out_dir: Path,
    duration_s: float | None = None,
) -> dict:
    """One measured segment: ``cfg.loadgens`` generator processes, each pinned to one
    generator core (unpinned where every part shares every core), sharing ``concurrency``
    clients and one window; merged results."""
    urls = [router.url for router in routers]
    router_pids = [router.process.pid for router in routers]
    load = dataclasses.replace(cfg.load, duration_s=duration_s or cfg.load.duration_s)
    start_at = time.time() + LOADGEN_START_S
    processes, outputs, offset = [], [], 0
    for index, share in enumerate(split_concurrency(concurrency, cfg.loadgens)):
        output = out_dir / f"loadgen-{index}.json"
        output.unlink(missing_ok=True)
        argv = loadgen_argv(
            rotated(urls, offset),
            dataclasses.replace(load, concurrency=share),
            stream,
            output,
            router_pids if index == 0 else (),
            backend_pids if index == 0 else (),
        )
        argv += ["--start-at", f"{start_at:.3f}", "--client", cfg.client]
        cores = cfg.plan.loadgens
        if not cfg.plan.router_shared:
            cores = (cores[index % len(cores)],)
        processes.append(
            subprocess.Popen(
                pinned(argv, cores), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO
            )
        )
        outputs.append(output)
        offset += share
    bound = LOADGEN_START_S + load.warmup_s + load.duration_s + SEGMENT_SLACK_S
    failures = []
    for process in processes:
        _, err = process.communicate(timeout=bound)
        if process.returncode != 0:
            failures.append(err.decode(errors="replace")[-1000:])
    if failures:
        raise RuntimeError("loadgen failed: " + "\n".join(failures))
    return merge_segments([orjson.loads(output.read_bytes()) for output in outputs])


def measure(
    cfg: ScaleConfig, log_dir: Path, stack: contextlib.ExitStack, workers_flag: bool
) -> tuple[dict[Key, Cell], dict[Setup, list[RouterProcess]], list[int]]:
    """Start the workers and every setup; run the interleaved rounds; the routers stay up
    (in ``stack``) for the profile."""
    load = cfg.load
    ports = iter(lambda: free_port(HOST), None)
    cluster = stack.enter_context(
        stub_cluster(
            load.prefill,
            load.decode,
            ports,
            processes_per_worker=cfg.backend_processes,
            cpus=cfg.plan.backends,
        )
    )
    topology, pids = backend_topology(cluster)
    groups: dict[Setup, list[RouterProcess]] = {}
    for setup in cfg.setups:
        routers = [
            stack.enter_context(running_router(peer, topology, log_dir))
            for peer in setup_peers(setup, cfg.plan.router, workers_flag)
        ]
        for router in routers:
            router.wait_ready()
        groups[setup] = routers
        print(f"# {setup.name} ready", file=sys.stderr)
    cells = {
        (s.name, c, m): Cell() for s in cfg.setups for c in cfg.concurrencies for m in load.modes
    }
    order = list(groups.items())
    for round_no in range(load.rounds):
        shift = round_no % len(order)
        for concurrency in cfg.concurrencies:
            for mode in load.modes:
                for setup, routers in order[shift:] + order[:shift]:
                    with busy_cores(setup.spun(cfg.plan.router)):
                        segment = run_segment(
                            routers, cfg, concurrency, mode == "stream", pids, log_dir
                        )
                    cells[(setup.name, concurrency, mode)].add(segment)
                    print(
                        f"# round {round_no + 1} c{concurrency:<4} {mode:10} {setup.name:26} "
                        f"{segment['completed'] / segment['window_s']:9.1f} req/s "
                        f"errors {segment['errors']}",
                        file=sys.stderr,
                    )
    return cells, groups, pids


def data_plane_pids(setup: Setup, routers: Sequence[RouterProcess]) -> list[int]:
    """The processes that serve clients: every pd-router of a separate setup, or the children
    of one pd-router started with --workers N > 1 (the control process is the parent)."""
    if setup.kind == "separate" or setup.count == 1:
        return [router.process.pid for router in routers]
    root = routers[0].process.pid
    return [pid for pid in process_tree(root) if pid != root] or [root]


def busiest(pids: Sequence[int], seconds: float) -> int:
    """The pid that used the most CPU over the next ``seconds``."""
    before = {pid: sum(cpu_seconds(pid)) for pid in pids}
    time.sleep(seconds)
    return max(pids, key=lambda pid: sum(cpu_seconds(pid)) - before[pid])


def profile_setup(
    cfg: ScaleConfig,
    groups: Mapping[Setup, list[RouterProcess]],
    backend_pids: Sequence[int],
    profile_s: float,
    out_dir: Path,
) -> str:
    """py-spy one data-plane process under non-streaming load at the highest concurrency;
    the sample shares as microseconds of the data planes' CPU per request."""
    pd_routers = [s for s in groups if s.kind != SMG]
    if not pd_routers:
        return "_no pd-router setup to profile_\n"
    setup = max(pd_routers, key=lambda s: (s.count, s.kind == "workers"))
    try:
        py_spy = ensure_py_spy()
    except PeerSetupError as exc:
        return f"_py-spy could not be installed: {exc}_\n"
    routers, concurrency = groups[setup], max(cfg.concurrencies)
    planes = data_plane_pids(setup, routers)
    raw = out_dir / "data-plane-profile.txt"
    with ThreadPoolExecutor(max_workers=1) as pool:
        load = pool.submit(
            run_segment, routers, cfg, concurrency, False, backend_pids, out_dir, profile_s + 2.0
        )
        time.sleep(LOADGEN_START_S + cfg.load.warmup_s)
        pid = busiest(planes, PROFILE_PICK_S)
        before = {p: cpu_seconds(p) for p in planes}
        spy = subprocess.run(
            [str(py_spy), "record", "--pid", str(pid), "--duration", str(int(profile_s)),
             "--rate", "200", "--format", "raw", "--output", str(raw), "--native"],
            capture_output=True, check=False, timeout=profile_s + 60.0,
        )  # fmt: skip
        after = {p: cpu_seconds(p) for p in planes}
        segment = load.result()
    if spy.returncode != 0 or not raw.exists():
        return f"_py-spy failed: {spy.stderr.decode(errors='replace')[-500:]}_\n"
    spent = {p: (after[p][0] - before[p][0], after[p][1] - before[p][1]) for p in planes}
    rps = segment["completed"] / segment["window_s"]
    return profile_report(setup, concurrency, rps, pid, spent, profile_s, raw)


def profile_report(
    setup: Setup,
    concurrency: int,
    rps: float,
    pid: int,
    spent: Mapping[int, tuple[float, float]],
    seconds: float,
    raw: Path,
) -> str:
    """Where the microseconds of one request go: the data planes' CPU over the profile's
    window per request served in it (py-spy pauses the process it samples, so that process
    alone serves less than its share), the user part split by the profiled process's
    user-space samples."""
    summary = summarize(raw)
    served = rps * seconds
    user_s = sum(user for user, _ in spent.values())
    system_s = sum(system for _, system in spent.values())
    user_us = 1e6 * user_s / served if served else float("nan")
    system_us = 1e6 * system_s / served if served else float("nan")
    spread = ", ".join(
        f"{sum(cpu) / seconds:.2f}{'*' if p == pid else ''}" for p, cpu in spent.items()
    )
    lines = [
        f"{setup.name}, non-streaming at concurrency {concurrency}: {rps:.0f} req/s under the "
        f"profiler. Data planes' CPU over the {seconds:.0f} s, in cores: {spread} (* the "
        f"profiled one, pid {pid}). Together they spent **{user_us + system_us:.1f} us of CPU "
        f"per request**: {user_us:.1f} us user, {system_us:.1f} us kernel. The user time is "
        f"split by the profiled process's user-space samples ({summary.user} of "
        f"{summary.total}); raw stacks: `{shown(raw)}`.",
        "",
        "| us/request | share of user time | where (deepest Python frame, native callees in) |",
        "|---:|---:|---|",
    ]
    for label, count in summary.self_samples.most_common(15):
        share = count / summary.user if summary.user else 0.0
        lines.append(f"| {share * user_us:.1f} | {100 * share:.1f}% | `{label}` |")
    lines += ["", "| us/request | share of user time | file |", "|---:|---:|---|"]
    for label, count in summary.self_by_file.most_common(12):
        share = count / summary.user if summary.user else 0.0
        lines.append(f"| {share * user_us:.1f} | {100 * share:.1f}% | `{label}` |")
    return "\n".join(lines) + "\n\n" + profile_markdown(summary)


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def goal_lines(cfg: ScaleConfig, cells: Mapping[Key, Cell]) -> list[str]:
    """The goals of issue 17 that this run's setups can answer, each with its figures: the
    largest --workers N against smg where each data plane has a router core of its own, one
    process against smg where the router has one core or shares every core with its load (the
    2-core goals), N processes against one; and, for reference, smg against itself on one
    core."""
    names = {s.name for s in cfg.setups}
    one = Setup("workers", 1).name
    many = [s for s in cfg.setups if s.kind == "workers" and s.count > 1]
    cores = len(cfg.plan.router)
    shared = cfg.plan.router_shared
    lines = []
    for concurrency in cfg.concurrencies:
        for mode in cfg.load.modes:
            where = f"c{concurrency} {mode}"
            figures = {name: cells[(name, concurrency, mode)].figures for name in names}
            smg = figures.get(SMG)
            top = max(many, key=lambda s: s.count, default=None)
            if smg is not None and top is not None and top.count <= cores and not shared:
                ours = figures[top.name]
                fast = ratio(ours.rps, smg.rps)
                cheap = ratio(ours.cpu_ms_per_request, smg.cpu_ms_per_request)
                tail = ratio(percentile(ours.latencies_ms, 99), percentile(smg.latencies_ms, 99))
                met = fast >= 1.5 and cheap <= 1.0 and tail <= 1.0
                lines.append(
                    f"- {where}: {top.name} vs smg: {fast:.2f}x req/s (goal >= 1.5), "
                    f"{cheap:.2f}x CPU/request (<= 1), {tail:.2f}x p99 (<= 1): {_met(met)}"
                )
            if smg is not None and one in names and (cores == 1 or shared):
                lead = ratio(figures[one].rps, smg.rps)
                lines.append(
                    f"- {where}: {one} vs smg: {lead:.2f}x req/s (2-core goal >= 1.1): "
                    f"{_met(lead >= 1.1)}"
                )
            for setup in many if one in names else ():
                gain = ratio(figures[setup.name].rps, figures[one].rps)
                if shared:
                    goal, why = 1.0, f"not slower: the routers share the {cores} cores"
                elif setup.count <= cores:
                    goal, why = 0.85 * setup.count, f"0.85 x {setup.count}"
                else:
                    goal, why = 1.0, f"not slower: more processes than the {cores} router cores"
                lines.append(
                    f"- {where}: {setup.name} vs one process: {gain:.2f}x req/s "
                    f"(goal >= {goal:.2f}, {why}): {_met(gain >= goal)}"
                )
            beside = figures.get(BUSY_ONE.name)
            for setup in many if beside is not None and not shared else ():
                if setup.count > cores:
                    continue
                gain = ratio(figures[setup.name].rps, setup.count * beside.rps)
                lines.append(
                    f"- {where}: {setup.name} vs {setup.count} x {BUSY_ONE.name}: {gain:.2f} "
                    "(one process as fast as the loaded machine lets one core run; no goal)"
                )
            smg_one = figures.get(SMG_ONE_CORE.name)
            if smg is not None and smg_one is not None and cores > 1 and not shared:
                peer = ratio(smg.rps, cores * smg_one.rps)
                lines.append(
                    f"- {where}: smg vs {cores} x smg on 1 core: {peer:.2f}x req/s (how the peer "
                    "itself scales on these cores; no goal)"
                )
    return lines


def _met(met: bool) -> str:
    return "**met**" if met else "**not met**"


TABLE_HEAD = (
    "| conc | mode | router | req/s | p50 ms | p99 ms | errors | router CPU ms/req "
    "| router cores busy | workers' cores busy | generators' cores busy (busiest) |\n"
    "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(concurrency: int, mode: str, name: str, cell: Cell, plan: CorePlan) -> str:
    f = cell.figures
    p50, p99 = percentile(f.latencies_ms, 50), percentile(f.latencies_ms, 99)
    busy = (lambda cpu_s: cpu_s / f.window_s) if f.window_s else (lambda cpu_s: math.nan)
    return (
        f"| {concurrency} | {mode} | {name} | {f.rps:.0f} | {p50:.1f} | {p99:.1f} | {f.errors} "
        f"| {f.cpu_ms_per_request:.3f} | {busy(f.router_cpu_s):.2f} of {len(plan.router)} "
        f"| {busy(f.backend_cpu_s):.2f} of {len(plan.backends)} "
        f"| {busy(f.loadgen_cpu_s):.2f} of {len(plan.loadgens)} ({100 * cell.loadgen_peak:.0f}%) |"
    )


def ratio_rows(cfg: ScaleConfig, cells: Mapping[Key, Cell]) -> list[str]:
    """Each pd-router setup against smg and against N times one process (against one process
    where the routers share every core: no setup has cores of its own to multiply); smg on
    more cores against as many times smg on one core, where the run has both: how the peer
    itself scales on this machine."""
    names = {s.name for s in cfg.setups}
    shared = cfg.plan.router_shared
    rows = [
        "| conc | mode | router | req/s vs smg | CPU/req vs smg | p99 vs smg "
        f"| req/s vs {'' if shared else 'N x '}one process (smg: one core) |",
        "|---:|---|---|---:|---:|---:|---:|",
    ]
    for concurrency in cfg.concurrencies:
        for mode in cfg.load.modes:
            figures = {name: cells[(name, concurrency, mode)].figures for name in names}
            smg = figures.get(SMG)
            for setup in cfg.setups:
                one = SMG_ONE_CORE if setup.kind == SMG else Setup("workers", 1)
                if setup == one or (setup.kind == SMG and one.name not in names):
                    continue
                f = figures[setup.name]
                vs = (
                    (
                        ratio(f.rps, smg.rps),
                        ratio(f.cpu_ms_per_request, smg.cpu_ms_per_request),
                        ratio(percentile(f.latencies_ms, 99), percentile(smg.latencies_ms, 99)),
                    )
                    if smg is not None and setup.kind != SMG
                    else (math.nan,) * 3
                )
                base = figures.get(one.name)
                multiple = 1 if shared else setup.multiple(cfg.plan.router)
                scaling = ratio(f.rps, multiple * base.rps) if base else math.nan
                times = [_times(value) for value in vs]
                rows.append(
                    f"| {concurrency} | {mode} | {setup.name} | {' | '.join(times)} "
                    f"| {_times(scaling).removesuffix('x')} |"
                )
    return rows


def _times(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def report(
    cfg: ScaleConfig,
    cells: Mapping[Key, Cell],
    skipped: Mapping[str, str],
    profile: str,
    command: str,
) -> str:
    load = cfg.load
    lines = [
        f"# Scaling across cores ({datetime.now(UTC):%Y-%m-%d %H:%M UTC})",
        "",
        f"Command: `{command}` at `{repo_revision()}`",
        "",
        f"{len(os.sched_getaffinity(0))} cores available (load average "
        f"{os.getloadavg()[0]:.1f} at the end): {cfg.plan.describe()}. {load.prefill}P"
        f"{load.decode}D stub workers ({cfg.backend_processes} process(es) per worker on one "
        f"port); {cfg.loadgens} load generator process(es) (bench/loadgen.py --client "
        f"{cfg.client}), each pinned to one generator core. "
        f"/generate, max_new_tokens {load.max_new_tokens}; {load.rounds} interleaved round(s) "
        f"of {load.warmup_s:g}s warm-up + {load.duration_s:g}s measured per setup, concurrency "
        "and mode; all setups up at once, idle while another is measured. Cores busy = CPU "
        "seconds / window seconds; router CPU covers every process of the setup.",
        "",
        TABLE_HEAD,
    ]
    for concurrency in cfg.concurrencies:
        for mode in load.modes:
            lines += [
                table_row(concurrency, mode, s.name, cells[(s.name, concurrency, mode)], cfg.plan)
                for s in cfg.setups
            ]
    lines += ["", *ratio_rows(cfg, cells), ""]
    lines += [f"- {name}: not measured ({why})" for name, why in skipped.items()]
    lines += ["", "Goals of issue 17:", "", *goal_lines(cfg, cells), ""]
    for (name, concurrency, mode), cell in cells.items():
        if cell.figures.error_samples:
            samples = "; ".join(e[:160] for e in cell.figures.error_samples)
            lines.append(f"- errors of {name} (c{concurrency} {mode}): {samples}")
    if profile:
        lines += ["", "## One data-plane process, profiled", "", profile]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> tuple[ScaleConfig, float]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--setups", default="smg,1,2,4,6", help="default %(default)s; Ns: N separate"
    )
    parser.add_argument("--concurrency", default="64,256", help="comma-separated, total clients")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds per segment")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per segment")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    available = sorted(os.sched_getaffinity(0))
    parser.add_argument(
        "--router-cores",
        type=int,
        default=default_router_cores(len(available)),
        help="cores for the routers (default: 6 on 16+ cores, else a third; %(default)s here)",
    )
    parser.add_argument(
        "--share-cores",
        action="store_true",
        help="no core split: routers, workers and generators all unpinned on every core",
    )
    parser.add_argument("--backend-cores", type=int, help="default: half the rest, rounded up")
    parser.add_argument("--backend-processes", type=int, help="per stub worker (default: fill)")
    parser.add_argument("--loadgens", type=int, help="generator processes (default: one a core)")
    parser.add_argument(
        "--client",
        choices=("fast", "aiohttp"),
        default="fast",
        help="the generators' HTTP client (bench/loadgen.py --client), default %(default)s",
    )
    parser.add_argument("--profile", type=float, default=0.0, help="py-spy one data plane N s")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="default: %(default)s")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a venv holding another build of pd-router, run by the setups named Nbase",
    )
    args = parser.parse_args(argv)
    try:
        setups = parse_setups(args.setups, args.baseline)
        concurrencies = tuple(int(c) for c in args.concurrency.split(",") if c)
        if args.share_cores:
            if any(setup.busy_neighbours for setup in setups):
                raise ValueError(f"{BUSY_NEIGHBOURS} needs router cores of their own")
            plan = shared_plan(available)
        else:
            plan = plan_cores(available, args.router_cores, args.backend_cores)
    except ValueError as exc:
        parser.error(str(exc))
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes must name some of {list(MODES)}")
    if not concurrencies or any(not 1 <= c <= 4096 for c in concurrencies):
        parser.error("--concurrency: values between 1 and 4096")
    workers = 4  # 2P2D
    backend_processes = args.backend_processes or max(1, 2 * len(plan.backends) // workers)
    load = BenchConfig(
        peers=(),
        modes=modes,
        concurrency=max(concurrencies),
        warmup_s=args.warmup,
        duration_s=args.duration,
        rounds=args.rounds,
        max_new_tokens=args.max_new_tokens,
        prefill=2,
        decode=2,
        profile_s=args.profile,
        backend="stub",
        results_dir=args.results_dir,
    )
    cfg = ScaleConfig(
        load=load,
        setups=setups,
        concurrencies=concurrencies,
        plan=plan,
        backend_processes=backend_processes,
        loadgens=args.loadgens or len(plan.loadgens),
        client=args.client,
    )
    return cfg, args.profile


def main(argv: Sequence[str] | None = None) -> int:
    cfg, profile_s = parse_args(argv)
    skipped: dict[str, str] = {}
    workers_flag = pd_router_has_workers_flag()
    if any(s.kind == "workers" and s.count > 1 for s in cfg.setups) and not workers_flag:
        skipped = {
            s.name: "this pd-router has no --workers"
            for s in cfg.setups
            if s.kind == "workers" and s.count > 1
        }
        cfg = dataclasses.replace(cfg, setups=tuple(s for s in cfg.setups if s.name not in skipped))
    try:
        for peer in {PEERS[SMG] if s.kind == SMG else PEERS["pd-router"] for s in cfg.setups}:
            ensure_peer(peer)
            check_peer(peer)
        for venv in {s.venv for s in cfg.setups if s.venv is not None}:
            if not (venv / "bin" / "pd-router").exists():
                raise PeerSetupError(f"baseline: {venv}/bin/pd-router is missing")
    except PeerSetupError as exc:
        print(f"peer setup failed: {exc}", file=sys.stderr)
        return 1
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = cfg.load.results_dir / f"scale-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        try:
            cells, groups, pids = measure(cfg, log_dir, stack, workers_flag)
        except RouterStartError as exc:
            print(f"router start failed: {exc}", file=sys.stderr)
            return 1
        profile = profile_setup(cfg, groups, pids, profile_s, log_dir) if profile_s > 0 else ""
    command = "python bench/scale.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(cfg, cells, skipped, profile, command.strip())
    written = cfg.load.results_dir / f"scale-{stamp}.md"
    written.write_text(text)
    print(text)
    print(f"# written to {shown(written)}", file=sys.stderr)
    errors = sum(c.figures.errors for (name, _, _), c in cells.items() if name != SMG)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
