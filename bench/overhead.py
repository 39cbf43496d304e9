"""Router overhead vs peers: pd-router, sglang-router's mini_lb and smg on the same 2P2D.

One run starts a cluster of reference workers (pd_worker, timing model off: speed 0, so the
workers answer as fast as their CPU allows), starts every router in front of it on its own
loopback port, and then drives each router in turn with the same closed-loop load (a separate
loadgen process, fixed concurrency, streaming and non-streaming /generate). Rounds interleave
the peers (the order rotates each round) because a shared 2-core machine drifts; figures are
summed over rounds. Reported per peer and mode: requests/s, p50/p99 latency, errors, and the
CPU time per request of the router's process tree, plus pd-router's ratios to each peer.

    .venv/bin/python bench/overhead.py                     # all peers, defaults below
    .venv/bin/python bench/overhead.py --peers pd-router --profile 10
    .venv/bin/python bench/overhead.py --backend stub      # instant workers: router-bound

Peers are installed on demand into bench/venvs/ (see bench/peers.py). Results go to stdout and
bench/results/overhead-<timestamp>.md. Exit status 1 if pd-router had any error or did not
start, or a peer could not be installed; a peer that does not start is reported and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson
from peers import (
    PEERS,
    REPO,
    Peer,
    PeerSetupError,
    Topology,
    check_peer,
    ensure_peer,
    ensure_py_spy,
    free_port,
)
from profile_summary import markdown as profile_markdown
from profile_summary import summarize
from stub_worker import StubCluster, stub_cluster

from pd_worker.cluster import WorkerCluster

HOST = "127.0.0.1"
BENCH = REPO / "bench"
RESULTS = BENCH / "results"
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
MODES = ("non-stream", "stream")
BASELINE = "pd-router"
BACKENDS = {
    "pd_worker": "pd_worker (speed 0)",
    "stub": "stub workers (bench/stub_worker.py: instant answers, no KV transfer)",
}


@dataclass(frozen=True)
class BenchConfig:
    """Everything one run needs; printed with the results so a figure can be reproduced."""

    peers: tuple[str, ...]
    modes: tuple[str, ...]
    concurrency: int
    warmup_s: float
    duration_s: float
    rounds: int
    max_new_tokens: int
    prefill: int
    decode: int
    profile_s: float
    backend: str
    results_dir: Path


@dataclass
class Figures:
    """Sums over the rounds of one (peer, mode)."""

    completed: int = 0
    errors: int = 0
    window_s: float = 0.0
    router_cpu_s: float = 0.0
    backend_cpu_s: float = 0.0
    loadgen_cpu_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def add(self, result: dict) -> None:
        self.completed += result["completed"]
        self.errors += result["errors"]
        self.window_s += result["window_s"]
        self.router_cpu_s += result["router_cpu_s"]
        self.backend_cpu_s += result["backend_cpu_s"]
        self.loadgen_cpu_s += result["loadgen_cpu_s"]
        self.latencies_ms += result["latencies_ms"]
        self.ttft_ms += result["ttft_ms"]
        self.error_samples += result["error_samples"][: 5 - len(self.error_samples)]

    @property
    def rps(self) -> float:
        return self.completed / self.window_s if self.window_s else 0.0

    @property
    def cpu_ms_per_request(self) -> float:
        return self._per_request_ms(self.router_cpu_s)

    @property
    def backend_cpu_ms_per_request(self) -> float:
        return self._per_request_ms(self.backend_cpu_s)

    def _per_request_ms(self, cpu_s: float) -> float:
        return 1000.0 * cpu_s / self.completed if self.completed else float("nan")


class RouterStartError(RuntimeError):
    """A router did not come up and serve a first request in time."""


def shown(path: Path) -> str:
    """A path as the report prints it: relative to the repo when inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = math.ceil(q / 100.0 * len(ordered))
    return ordered[max(0, min(len(ordered), rank) - 1)]


@dataclass
class RouterProcess:
    """One running router: its process, port and log file."""

    peer: Peer
    port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll with a real /generate until it succeeds: /health alone says nothing about pairs."""
        deadline = time.monotonic() + timeout_s
        body = {"text": "ready?", "sampling_params": {"max_new_tokens": 2}}
        last = "no answer yet"
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RouterStartError(
                        f"{self.peer.name} exited with {self.process.returncode} "
                        f"(log: {shown(self.log_path)}):\n{self.log_tail()}"
                    )
                try:
                    resp = client.post(f"{self.url}/generate", json=body)
                    if resp.status_code == 200 and "text" in resp.json():
                        return
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.25)
        raise RouterStartError(f"{self.peer.name} not ready after {timeout_s:.0f}s ({last})")

    def stop(self) -> None:
        """SIGTERM the router's own process group, SIGKILL it if it lingers."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STOP_TIMEOUT_S)


@contextlib.contextmanager
def running_router(peer: Peer, topology: Topology, log_dir: Path) -> Iterator[RouterProcess]:
    """Start peer in front of topology in its own session; always stop it on exit. It runs in
    ``log_dir``, not the checkout: a pd-router of another build (a baseline venv) starts its
    data planes with ``python -m``, which would import the checkout's pd_router from there."""
    port = free_port(HOST)
    log_path = log_dir / f"{peer.name}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            peer.argv(topology, HOST, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=log_dir,
        )
    router = RouterProcess(peer=peer, port=port, process=process, log_path=log_path)
    try:
        yield router
    finally:
        router.stop()


def loadgen_argv(
    urls: Sequence[str],
    cfg: BenchConfig,
    stream: bool,
    output: Path,
    cpu_pids: Sequence[int] = (),
    backend_pids: Sequence[int] = (),
) -> list[str]:
    """The command line of one loadgen process: ``cfg.concurrency`` clients spread over urls,
    reading the CPU of the routers (cpu_pids) and workers (backend_pids) at the window's edges."""
    argv = [
        sys.executable,
        str(BENCH / "loadgen.py"),
        "--concurrency",
        str(cfg.concurrency),
        "--warmup",
        str(cfg.warmup_s),
        "--duration",
        str(cfg.duration_s),
        "--max-new-tokens",
        str(cfg.max_new_tokens),
        "--output",
        str(output),
    ]
    for url in urls:
        argv += ["--url", f"{url}/generate"]
    for pid in cpu_pids:
        argv += ["--cpu-pid", str(pid)]
    for pid in backend_pids:
        argv += ["--backend-pid", str(pid)]
    if stream:
        argv.append("--stream")
    return argv


def run_load(
    routers: Sequence[RouterProcess],
    cfg: BenchConfig,
    stream: bool,
    out_dir: Path,
    backend_pids: Sequence[int] = (),
) -> dict:
    """One measured segment: the loadgen process against one router, or its clients spread
    over several (replicas); the CPU of all of them is read."""
    output = out_dir / "loadgen.json"
    urls = [router.url for router in routers]
    pids = [router.process.pid for router in routers]
    argv = loadgen_argv(urls, cfg, stream, output, pids, backend_pids)
    bound = cfg.warmup_s + cfg.duration_s + 120.0
    done = subprocess.run(argv, capture_output=True, timeout=bound, check=False, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen failed: {done.stderr.decode(errors='replace')[-2000:]}")
    return orjson.loads(output.read_bytes())


def profile_router(router: RouterProcess, cfg: BenchConfig, out_dir: Path) -> str:
    """py-spy a pd-router under the load of the first mode (not counted in the figures)."""
    try:
        py_spy = ensure_py_spy()
    except PeerSetupError as exc:
        return f"_py-spy could not be installed: {exc}_\n"
    raw = out_dir / "pd-router-profile.txt"
    spy = subprocess.Popen(
        [
            str(py_spy),
            "record",
            "--pid",
            str(router.process.pid),
            "--duration",
            str(int(cfg.profile_s)),
            "--rate",
            "200",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--native",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    profiled = dataclasses.replace(cfg, warmup_s=1.0, duration_s=cfg.profile_s + 1.0, rounds=1)
    mode = cfg.modes[0]
    result = run_load([router], profiled, mode == "stream", out_dir)
    _, err = spy.communicate(timeout=cfg.profile_s + 60.0)
    if spy.returncode != 0 or not raw.exists():
        return f"_py-spy failed: {err.decode(errors='replace')[-500:]}_\n"
    header = (
        f"Profiled {cfg.profile_s:.0f}s of {mode} load at concurrency {cfg.concurrency} "
        f"({result['completed'] / result['window_s']:.0f} req/s under the profiler, "
        f"{result['errors']} errors); raw stacks: `{shown(raw)}`.\n\n"
    )
    return header + profile_markdown(summarize(raw))


def start_backend(cfg: BenchConfig) -> contextlib.AbstractContextManager:
    """The workers behind the routers: pd_worker processes, or stubs that answer at once."""
    if cfg.backend == "stub":
        return stub_cluster(cfg.prefill, cfg.decode, iter(lambda: free_port(HOST), None))
    return WorkerCluster(cfg.prefill, cfg.decode, speed=0.0, enable_faults=False)


def backend_topology(cluster: StubCluster | WorkerCluster) -> tuple[Topology, list[int]]:
    """Where a started backend's workers listen, and their pids (for their CPU)."""
    topology = Topology(
        prefills=tuple((url, cluster.bootstrap_port(url)) for url in cluster.prefill_urls),
        decodes=tuple(cluster.decode_urls),
    )
    if isinstance(cluster, StubCluster):
        return topology, cluster.pids
    return topology, [worker.process.pid for worker in cluster.workers]


@dataclass
class Measurement:
    """What one run found: sums per (peer, mode), the profile, and peers that never served."""

    figures: dict[tuple[str, str], Figures]
    profile: str = ""
    not_started: dict[str, str] = field(default_factory=dict)

    def measured(self, peers: Sequence[str]) -> list[str]:
        return [name for name in peers if name not in self.not_started]


def start_routers(
    cfg: BenchConfig, topology: Topology, log_dir: Path, stack: contextlib.ExitStack
) -> tuple[list[RouterProcess], dict[str, str]]:
    """Start every peer and wait until each serves; a peer other than pd-router that does not
    come up is reported and left out instead of ending the run."""
    ready, not_started = [], {}
    for name in cfg.peers:
        router = stack.enter_context(running_router(PEERS[name], topology, log_dir))
        try:
            router.wait_ready()
        except RouterStartError as exc:
            if name == BASELINE:
                raise
            not_started[name] = str(exc).splitlines()[0]
            router.stop()
            continue
        print(f"# {name} ready on {router.url}", file=sys.stderr)
        ready.append(router)
    return ready, not_started


def measure(cfg: BenchConfig, log_dir: Path) -> Measurement:
    """Start the cluster and every router, run the interleaved rounds, return the sums."""
    result = Measurement({(name, mode): Figures() for name in cfg.peers for mode in cfg.modes})
    with start_backend(cfg) as cluster:
        topology, pids = backend_topology(cluster)
        with contextlib.ExitStack() as stack:
            routers, result.not_started = start_routers(cfg, topology, log_dir, stack)
            for round_no in range(cfg.rounds):
                shift = round_no % len(routers)
                for mode in cfg.modes:
                    for router in routers[shift:] + routers[:shift]:
                        segment = run_load([router], cfg, mode == "stream", log_dir, pids)
                        result.figures[(router.peer.name, mode)].add(segment)
                        print(
                            f"# round {round_no + 1} {mode:10} {router.peer.name:10} "
                            f"{segment['completed'] / segment['window_s']:8.1f} req/s "
                            f"errors {segment['errors']}",
                            file=sys.stderr,
                        )
            baseline = next((r for r in routers if r.peer.name == BASELINE), None)
            if cfg.profile_s > 0 and baseline is not None:
                result.profile = profile_router(baseline, cfg, log_dir)
    return result


def ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x" if denominator else "n/a"


TABLE_HEAD = (
    "| mode | router | req/s | p50 ms | p99 ms | errors | stream TTFT p50 ms "
    "| router CPU ms/req | router CPU % | workers CPU ms/req | loadgen CPU % |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(mode: str, name: str, f: Figures) -> str:
    """One line of the figures table."""
    p50, p99 = percentile(f.latencies_ms, 50), percentile(f.latencies_ms, 99)
    router_pct = 100 * f.router_cpu_s / f.window_s
    loadgen_pct = 100 * f.loadgen_cpu_s / f.window_s
    ttft = f"{percentile(f.ttft_ms, 50):.1f}" if f.ttft_ms else "-"
    return (
        f"| {mode} | {name} | {f.rps:.0f} | {p50:.1f} | {p99:.1f} | {f.errors} | {ttft} "
        f"| {f.cpu_ms_per_request:.3f} | {router_pct:.0f} | {f.backend_cpu_ms_per_request:.3f} "
        f"| {loadgen_pct:.0f} |"
    )


def repo_revision() -> str:
    """The commit the figures were taken at, marked when the work tree had local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "pd_router"],
            capture_output=True,
            text=True,
            cwd=REPO,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{head}{' + local pd_router changes' if dirty else ''}" if head else "unknown"


def report(cfg: BenchConfig, measurement: Measurement, command: str) -> str:
    """The markdown written to bench/results and printed: setup, figures, ratios, profile."""
    figures, peers = measurement.figures, measurement.measured(cfg.peers)
    lines = [
        f"# Router overhead vs peers ({datetime.now(UTC):%Y-%m-%d %H:%M UTC})",
        "",
        f"Command: `{command}` at `{repo_revision()}`",
        "",
        f"{cfg.prefill}P{cfg.decode}D {BACKENDS[cfg.backend]} on {os.cpu_count()} cores; "
        f"concurrency {cfg.concurrency}; /generate, max_new_tokens {cfg.max_new_tokens}; "
        f"{cfg.rounds} interleaved round(s) of {cfg.warmup_s:g}s warm-up + "
        f"{cfg.duration_s:g}s measured per peer and mode.",
        "",
        TABLE_HEAD,
    ]
    lines += [table_row(mode, name, figures[(name, mode)]) for mode in cfg.modes for name in peers]
    lines += ["", "Peers: " + "; ".join(f"{n}: {PEERS[n].description}" for n in cfg.peers), ""]
    lines += [f"- {name} did not start: {why}" for name, why in measurement.not_started.items()]
    others = [name for name in peers if name != BASELINE]
    if BASELINE in peers and others:
        lines += ["| mode | ratio | req/s | router CPU per request |", "|---|---|---:|---:|"]
        for mode in cfg.modes:
            ours = figures[(BASELINE, mode)]
            for name in others:
                theirs = figures[(name, mode)]
                lines.append(
                    f"| {mode} | {BASELINE} / {name} | {ratio(ours.rps, theirs.rps)} | "
                    f"{ratio(ours.cpu_ms_per_request, theirs.cpu_ms_per_request)} |"
                )
        lines.append("")
    samples = [(key, f.error_samples) for key, f in figures.items() if f.error_samples]
    for (name, mode), errors in samples:
        lines.append(f"- errors of {name} ({mode}): " + "; ".join(e[:160] for e in errors))
    if measurement.profile:
        lines += ["", "## pd-router profile", "", measurement.profile]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> BenchConfig:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="comma-separated subset of %(default)s"
    )
    add_load_options(parser)
    parser.add_argument("--profile", type=float, default=0.0, help="py-spy pd-router for N seconds")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="default: %(default)s")
    parser.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default="pd_worker",
        help="stub: workers that answer at once, so the routers are the bottleneck",
    )
    args = parser.parse_args(argv)
    peers = tuple(p for p in args.peers.split(",") if p)
    modes = tuple(m for m in args.modes.split(",") if m)
    if not peers or any(p not in PEERS for p in peers):
        parser.error(f"--peers must name some of {list(PEERS)}")
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes must name some of {list(MODES)}")
    if not (1 <= args.concurrency <= 1024 and 0 < args.duration <= 120 and 0 <= args.warmup <= 60):
        parser.error("need 1 <= --concurrency <= 1024, 0 < --duration <= 120, 0 <= --warmup <= 60")
    if not (1 <= args.rounds <= 10 and 0 <= args.profile <= 120):
        parser.error("need 1 <= --rounds <= 10 and 0 <= --profile <= 120")
    return BenchConfig(
        peers=peers,
        modes=modes,
        concurrency=args.concurrency,
        warmup_s=args.warmup,
        duration_s=args.duration,
        rounds=args.rounds,
        max_new_tokens=args.max_new_tokens,
        prefill=args.prefill,
        decode=args.decode,
        profile_s=args.profile,
        backend=args.backend,
        results_dir=args.results_dir,
    )


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """The load every router-throughput benchmark runs (this one and replica_throughput.py)."""
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated subset of %(default)s"
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds per segment")
    parser.add_argument("--duration", type=float, default=8.0, help="measured seconds per segment")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    try:
        for name in cfg.peers:
            ensure_peer(PEERS[name])
            check_peer(PEERS[name])
    except PeerSetupError as exc:
        print(f"peer setup failed: {exc}", file=sys.stderr)
        return 1
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = cfg.results_dir / f"overhead-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        measurement = measure(cfg, log_dir)
    except RouterStartError as exc:
        print(f"router start failed: {exc}", file=sys.stderr)
        return 1
    command = "python bench/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(cfg, measurement, command.strip())
    written = cfg.results_dir / f"overhead-{stamp}.md"
    written.write_text(text)
    print(text)
    print(f"# written to {shown(written)}", file=sys.stderr)
    baseline_errors = sum(
        measurement.figures[(BASELINE, m)].errors for m in cfg.modes if BASELINE in cfg.peers
    )
    return 1 if baseline_errors else 0


if __name__ == "__main__":
    sys.exit(main())
