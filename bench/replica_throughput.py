"""Replica throughput: the same workers behind 1, 2 and 3 routers, side by side in one run.

One run starts the workers (reference workers at speed 0, or ``--backend stub``), a
single-member etcd, and every configuration of ``--routers`` at once: ``1`` is one pd-router
without ``[cluster]`` (in-memory state, as before replicas), ``N`` >= 2 is N pd-router
processes started with ``--etcd URL --cluster replicas-N`` (one cluster per configuration on
the same etcd), ``Ni`` is N independent pd-routers without etcd (the same split of the load
over N processes without a cluster: what the split itself costs). Each configuration is then
driven in turn by the same closed-loop load as bench/overhead.py (bench/loadgen.py in its own
process, ``--concurrency`` clients), the clients spread over the configuration's routers
(client i to router i mod N); rounds interleave the configurations with a rotating order.
Reported per configuration and mode: requests/s, latency, errors, and the CPU of all its
routers together, per request and in cores.

    .venv/bin/python bench/replica_throughput.py                    # 1, 2, 3 routers, pd_worker
    .venv/bin/python bench/replica_throughput.py --backend stub     # instant workers
    .venv/bin/python bench/replica_throughput.py --routers 1,2,2i,3,3i   # + routers without etcd

On a machine with fewer cores than routers + workers + load generator, more routers cannot add
throughput: the figures show what splitting one load over more router processes costs on shared
cores (CPU per request, latency) and whether membership in a cluster adds to it, not how
replicas scale when each has cores of its own. Results go to stdout and
bench/results/replicas-<timestamp>.md; exit status 1 if any configuration had an error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from etcd_process import EtcdStartError, running_etcd
from overhead import (
    BACKENDS,
    MODES,
    RESULTS,
    TABLE_HEAD,
    BenchConfig,
    Figures,
    RouterProcess,
    RouterStartError,
    add_load_options,
    backend_topology,
    ratio,
    repo_revision,
    run_load,
    running_router,
    shown,
    start_backend,
    table_row,
)
from peers import PEERS, ArgvBuilder, Peer, Topology
from router_process import wait_replicas

BASELINE_ROUTERS = 1
MAX_ROUTERS = 8


@dataclass(frozen=True)
class Configuration:
    """One line of the comparison: how many routers and whether they are replicas on etcd
    (``replicas`` False: independent routers, each alone with the same workers, the same load
    split over more processes without any etcd)."""

    routers: int
    replicas: bool = True

    @property
    def on_etcd(self) -> bool:
        return self.replicas and self.routers > 1

    @property
    def name(self) -> str:
        if self.routers == 1:
            return "1 router"
        return f"{self.routers} replicas" if self.replicas else f"{self.routers} routers, no etcd"

    @property
    def cluster(self) -> str:
        return f"replicas-{self.routers}" if self.replicas else f"alone-{self.routers}"


def replica_argv(
    etcd_url: str, cluster: str, bin_dir: Path, topology: Topology, host: str, port: int
) -> list[str]:
    """pd-router as bench/overhead.py starts it, joined to ``cluster`` on ``etcd_url``."""
    argv = PEERS["pd-router"].build_argv(bin_dir, topology, host, port)
    return [*argv, "--etcd", etcd_url, "--cluster", cluster]


def with_processes(build: ArgvBuilder, processes: int) -> ArgvBuilder:
    """``build`` with ``--workers processes`` (data planes per router) when more than one."""
    if processes == 1:
        return build

    def argv(bin_dir: Path, topology: Topology, host: str, port: int) -> list[str]:
        return [*build(bin_dir, topology, host, port), "--workers", str(processes)]

    return argv


def router_peers(configuration: Configuration, etcd_url: str, processes: int = 1) -> list[Peer]:
    """The routers of one configuration, each with its own name (its log file's) and
    ``processes`` data planes."""
    if configuration.routers == 1:
        alone = PEERS["pd-router"]
        return [dataclasses.replace(alone, build_argv=with_processes(alone.build_argv, processes))]
    build = with_processes(
        functools.partial(replica_argv, etcd_url, configuration.cluster)
        if configuration.replicas
        else PEERS["pd-router"].build_argv,
        processes,
    )
    return [
        Peer(
            name=f"{configuration.cluster}-{index}",
            venv_name=None,
            packages=(),
            build_argv=build,
            help_argv=PEERS["pd-router"].help_argv,
            description=f"pd-router {index} of {configuration.name}",
        )
        for index in range(configuration.routers)
    ]


def start_configuration(
    configuration: Configuration,
    etcd_url: str,
    topology: Topology,
    log_dir: Path,
    stack: contextlib.ExitStack,
    processes: int = 1,
) -> list[RouterProcess]:
    """Start one configuration's routers; return once each serves a first /generate and,
    for replicas, every one lists all the others."""
    routers = [
        stack.enter_context(running_router(peer, topology, log_dir))
        for peer in router_peers(configuration, etcd_url, processes)
    ]
    for router in routers:
        router.wait_ready()
    if configuration.on_etcd:
        wait_replicas([router.url for router in routers])
    print(f"# {configuration.name} ready", file=sys.stderr)
    return routers


def measure(
    cfg: BenchConfig,
    configurations: Sequence[Configuration],
    etcd_binary: str,
    log_dir: Path,
    processes: int = 1,
) -> dict[tuple[str, str], Figures]:
    """Start the backend, etcd and every configuration (each router with ``processes`` data
    planes); run the interleaved rounds."""
    figures = {(c.name, mode): Figures() for c in configurations for mode in cfg.modes}
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(start_backend(cfg))
        topology, pids = backend_topology(cluster)
        etcd_url = stack.enter_context(running_etcd(etcd_binary))
        groups = [
            (c, start_configuration(c, etcd_url, topology, log_dir, stack, processes))
            for c in configurations
        ]
        for round_no in range(cfg.rounds):
            shift = round_no % len(groups)
            for mode in cfg.modes:
                for configuration, routers in groups[shift:] + groups[:shift]:
                    segment = run_load(routers, cfg, mode == "stream", log_dir, pids)
                    figures[(configuration.name, mode)].add(segment)
                    print(
                        f"# round {round_no + 1} {mode:10} {configuration.name:10} "
                        f"{segment['completed'] / segment['window_s']:8.1f} req/s "
                        f"errors {segment['errors']}",
                        file=sys.stderr,
                    )
    return figures


def report(
    cfg: BenchConfig,
    configurations: Sequence[Configuration],
    figures: dict[tuple[str, str], Figures],
    command: str,
) -> str:
    """The markdown written to bench/results and printed: setup, figures, ratios to 1 router."""
    lines = [
        f"# Replica throughput ({datetime.now(UTC):%Y-%m-%d %H:%M UTC})",
        "",
        f"Command: `{command}` at `{repo_revision()}`",
        "",
        f"{cfg.prefill}P{cfg.decode}D {BACKENDS[cfg.backend]} on {os.cpu_count()} cores "
        f"(load average {os.getloadavg()[0]:.1f} at the end); concurrency {cfg.concurrency} "
        f"spread over each configuration's routers; /generate, max_new_tokens "
        f"{cfg.max_new_tokens}; {cfg.rounds} interleaved round(s) of {cfg.warmup_s:g}s warm-up "
        f"+ {cfg.duration_s:g}s measured per configuration and mode. Router CPU is the sum over "
        "the configuration's routers.",
        "",
        TABLE_HEAD,
    ]
    lines += [
        table_row(mode, c.name, figures[(c.name, mode)])
        for mode in cfg.modes
        for c in configurations
    ]
    baseline = next((c for c in configurations if c.routers == BASELINE_ROUTERS), None)
    others = [c for c in configurations if c is not baseline]
    if baseline is not None and others:
        lines += ["", "| mode | ratio | req/s | router CPU per request |", "|---|---|---:|---:|"]
        for mode in cfg.modes:
            ours = figures[(baseline.name, mode)]
            for c in others:
                theirs = figures[(c.name, mode)]
                lines.append(
                    f"| {mode} | {c.name} / {baseline.name} | {ratio(theirs.rps, ours.rps)} | "
                    f"{ratio(theirs.cpu_ms_per_request, ours.cpu_ms_per_request)} |"
                )
    samples = [(key, f.error_samples) for key, f in figures.items() if f.error_samples]
    lines += [""] if samples else []
    for (name, mode), errors in samples:
        lines.append(f"- errors of {name} ({mode}): " + "; ".join(e[:160] for e in errors))
    return "\n".join(lines) + "\n"


def parse_configurations(text: str) -> tuple[Configuration, ...]:
    """``"1,2,3,2i"`` -> one configuration per distinct entry, in the order given: N routers
    as replicas on etcd, or with an ``i`` suffix N independent routers without etcd."""
    entries = [part.strip() for part in text.split(",") if part.strip()]
    counts = [(int(entry.removesuffix("i")), entry.endswith("i")) for entry in entries]
    configurations = [Configuration(n, replicas=n > 1 and not alone) for n, alone in counts]
    if not configurations or any(not 1 <= c.routers <= MAX_ROUTERS for c in configurations):
        raise ValueError(f"router counts must be between 1 and {MAX_ROUTERS}")
    return tuple(dict.fromkeys(configurations))


def parse_args(
    argv: Sequence[str] | None,
) -> tuple[BenchConfig, tuple[Configuration, ...], str, int]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--routers",
        default="1,2,3",
        help="router counts, default %(default)s; N as replicas on etcd, Ni: N independent "
        "routers without etcd (the same split of the load, no cluster)",
    )
    add_load_options(parser)
    parser.add_argument("--backend", choices=tuple(BACKENDS), default="pd_worker")
    parser.add_argument("--etcd-binary", default="etcd", help="etcd for the replicas")
    parser.add_argument(
        "--router-workers", type=int, default=1, help="data-plane processes of each router"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="default: %(default)s")
    args = parser.parse_args(argv)
    try:
        configurations = parse_configurations(args.routers)
    except ValueError as exc:
        parser.error(f"--routers: {exc}")
    modes = tuple(m for m in args.modes.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes must name some of {list(MODES)}")
    if not (1 <= args.concurrency <= 1024 and 0 < args.duration <= 120 and 0 <= args.warmup <= 60):
        parser.error("need 1 <= --concurrency <= 1024, 0 < --duration <= 120, 0 <= --warmup <= 60")
    if not 1 <= args.rounds <= 10:
        parser.error("need 1 <= --rounds <= 10")
    cfg = BenchConfig(
        peers=("pd-router",),
        modes=modes,
        concurrency=args.concurrency,
        warmup_s=args.warmup,
        duration_s=args.duration,
        rounds=args.rounds,
        max_new_tokens=args.max_new_tokens,
        prefill=args.prefill,
        decode=args.decode,
        profile_s=0.0,
        backend=args.backend,
        results_dir=args.results_dir,
    )
    return cfg, configurations, args.etcd_binary, args.router_workers


def main(argv: Sequence[str] | None = None) -> int:
    cfg, configurations, etcd_binary, processes = parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = cfg.results_dir / f"replicas-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        figures = measure(cfg, configurations, etcd_binary, log_dir, processes)
    except (RouterStartError, EtcdStartError) as exc:
        print(f"start failed: {exc}", file=sys.stderr)
        return 1
    command = "python bench/replica_throughput.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = report(cfg, configurations, figures, command.strip())
    written = cfg.results_dir / f"replicas-{stamp}.md"
    written.write_text(text)
    print(text)
    print(f"# written to {shown(written)}", file=sys.stderr)
    return 1 if any(f.errors for f in figures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
