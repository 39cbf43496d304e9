"""Cache-aware routing: prefix-cache hit rate and TTFT of three routings on the same 2P2D.

A shared-prefix workload as SGLang's ``bench_serving --dataset-name generated-shared-prefix``
builds it: ``--groups`` long system prompts, ``--prompts-per-group`` questions under each, every
request ``system prompt + question`` (random characters, seeded; the reference worker's
tokenizer makes one token per byte), sent in one seeded shuffled order. Four ``pd_worker``
processes with the ``h100-8b`` timing profile and a prefix cache each; their KV capacity
(``--kv-tokens``) holds every system prompt in the two prefills together but not in either
alone, as on a deployment with more shared prefixes than one GPU keeps. The same requests go,
one configuration after the other, through:

- pd-router ``least_inflight`` (the default policy: prefix-blind),
- pd-router ``cache_aware``,
- pd-router ``cache_aware`` with ``--workers 4`` (a control process and four data planes, each
  with its own tree),
- smg 1.13 ``smg launch --pd-disaggregation --policy cache_aware``,

with every worker's cache flushed before each configuration. Closed loop: ``--concurrency``
clients send streaming ``/generate`` and read each answer to the end. Reported per
configuration: the prefix-cache hit rate (the prefill workers' ``sglang:cached_tokens_total``
over ``sglang:prompt_tokens_total``, counted during the run), each prefill's share of the
prompt tokens, the groups whose requests went to both prefills and the requests that missed
their system prompt though not first of their group (from each answer's ``meta_info``:
``kv_source``, ``cached_tokens``), TTFT (first SSE event) and end-to-end latency percentiles,
errors.

    .venv/bin/python bench/cache_aware.py
    .venv/bin/python bench/cache_aware.py --only "pd-router cache_aware" --groups 8

smg is installed on demand into bench/venvs/ (see bench/peers.py). The report goes to stdout
and bench/results/cache-aware-<timestamp>.md. Exit status 1 when a pd-router configuration had
errors or did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import shlex
import string
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import httpx
import orjson
from overhead import RESULTS, RouterStartError, percentile, repo_revision, running_router
from peers import PEERS, Peer, PeerSetupError, Topology, check_peer, ensure_peer

from pd_worker.cluster import WorkerCluster

REQUEST_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Config:
    groups: int
    prompts_per_group: int
    system_len: int
    question_len: int
    output_len: int
    concurrency: int
    kv_tokens: int
    speed: float
    seed: int
    rounds: int
    only: tuple[str, ...]


@dataclass
class Run:
    """What one configuration did with the workload."""

    ttft: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    cached_tokens: float = 0.0
    # prompt tokens each prefill worker was given (how the router split the traffic)
    prompt_tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    seconds: float = 0.0
    # system prompt -> the prefills (the decode's meta_info.kv_source) its requests went to
    served: dict[str, set[str]] = field(default_factory=dict)
    # groups whose requests went to more than one prefill, summed over rounds
    split_groups: int = 0
    # system prompt -> (sending order, whether the answer reported it cached) of its requests
    prefix_hits: dict[str, list[tuple[int, bool]]] = field(default_factory=dict)
    # requests that missed their system prompt though not the first of their group
    late_misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = sum(self.prompt_tokens)
        return self.cached_tokens / total if total else 0.0

    def add(self, other: Run) -> None:
        """Pool another round of the same configuration into this one."""
        self.ttft += other.ttft
        self.latency += other.latency
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error
        self.cached_tokens += other.cached_tokens
        self.prompt_tokens = [
            a + b for a, b in zip(self.prompt_tokens, other.prompt_tokens, strict=True)
        ]
        self.seconds += other.seconds
        self.split_groups += other.split_groups
        self.late_misses += other.late_misses


def with_policy(name: str, base: Peer, policy: str, *more: str) -> Peer:
    """``base`` started with ``--policy policy`` (the last --policy on a command line wins)
    and ``more`` arguments."""

    def argv(bin_dir: Path, topology: Topology, host: str, port: int) -> list[str]:
        return [*base.build_argv(bin_dir, topology, host, port), "--policy", policy, *more]

    return dataclasses.replace(base, name=name, build_argv=argv)


CONFIGURATIONS: dict[str, Peer] = {
    "pd-router least_inflight": with_policy(
        "pd-router least_inflight", PEERS["pd-router"], "least_inflight"
    ),
    "pd-router cache_aware": with_policy(
        "pd-router cache_aware", PEERS["pd-router"], "cache_aware"
    ),
    "pd-router cache_aware 4 processes": with_policy(
        "pd-router cache_aware 4 processes", PEERS["pd-router"], "cache_aware", "--workers", "4"
    ),
    "smg cache_aware": with_policy("smg cache_aware", PEERS["smg"], "cache_aware"),
}


def workload(cfg: Config) -> list[str]:
    """The prompts in sending order: every group's questions under its system prompt, shuffled."""
    rng = random.Random(cfg.seed)
    alphabet = string.ascii_letters + string.digits + "     "

    def text(length: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(length))

    prompts = []
    for _ in range(cfg.groups):
        system = text(cfg.system_len)
        prompts += [system + text(cfg.question_len) for _ in range(cfg.prompts_per_group)]
    rng.shuffle(prompts)
    return prompts


async def one_request(
    session: aiohttp.ClientSession, url: str, sent: int, prompt: str, cfg: Config, run: Run
) -> None:
    """Send one streaming /generate; record its TTFT and latency, or an error."""
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": cfg.output_len, "temperature": 0},
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    last = b""
    done = False
    try:
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if first is None:
                    first = time.perf_counter() - started
                if line.strip() == b"data: [DONE]":
                    done = True
                else:
                    last = line
        if not done or first is None:
            raise ValueError("stream ended without [DONE]")
        meta = orjson.loads(last[len(b"data:") :])["meta_info"]
        source, cached = meta["kv_source"], meta["cached_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        run.errors += 1
        run.first_error = run.first_error or f"{type(exc).__name__}: {exc}"
        return
    run.ttft.append(first)
    run.latency.append(time.perf_counter() - started)
    group = prompt[: cfg.system_len]
    run.served.setdefault(group, set()).add(source)
    run.prefix_hits.setdefault(group, []).append((sent, cached >= cfg.system_len // 2))


async def drive(url: str, prompts: Sequence[str], cfg: Config) -> Run:
    """Closed loop: ``cfg.concurrency`` clients take the prompts in order."""
    run = Run()
    queue = enumerate(prompts)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=cfg.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            for sent, prompt in queue:
                await one_request(session, url, sent, prompt, cfg, run)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(cfg.concurrency)))
        run.seconds = time.perf_counter() - started
    return run


def counter(metrics: str, name: str) -> float:
    """A worker's ``sglang:<name>_total`` from its /metrics text."""
    prefix = f"sglang:{name}_total{{"
    for line in metrics.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise ValueError(f"sglang:{name}_total missing from the worker's /metrics")


def prefill_counters(cluster: WorkerCluster) -> tuple[float, list[float]]:
    """Cached tokens counted by the prefill workers so far, and each one's prompt tokens."""
    cached = 0.0
    prompt = []
    with httpx.Client(timeout=10.0) as client:
        for url in cluster.prefill_urls:
            text = client.get(url + "/metrics").text
            cached += counter(text, "cached_tokens")
            prompt.append(counter(text, "prompt_tokens"))
    return cached, prompt


def flush_when_idle(cluster: WorkerCluster) -> None:
    """Empty every worker's prefix cache (a worker refuses while it still has requests)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    with httpx.Client(timeout=10.0) as client:
        for url in cluster.urls:
            while client.post(url + "/flush_cache").status_code != 200:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{url} did not become idle to flush its cache")
                time.sleep(0.1)


def measure(peer: Peer, cluster: WorkerCluster, prompts: list[str], cfg: Config, logs: Path) -> Run:
    """One configuration over the workload, on freshly flushed workers."""
    topology = Topology(
        prefills=tuple((url, cluster.bootstrap_port(url)) for url in cluster.prefill_urls),
        decodes=tuple(cluster.decode_urls),
    )
    with running_router(peer, topology, logs) as router:
        router.wait_ready()
        flush_when_idle(cluster)
        cached_before, prompt_before = prefill_counters(cluster)
        run = asyncio.run(drive(router.url, prompts, cfg))
        cached_after, prompt_after = prefill_counters(cluster)
    run.split_groups = sum(len(sources) > 1 for sources in run.served.values())
    run.late_misses = sum(
        not hit for hits in run.prefix_hits.values() for _, hit in sorted(hits)[1:]
    )
    run.cached_tokens = cached_after - cached_before
    run.prompt_tokens = [
        after - before for after, before in zip(prompt_after, prompt_before, strict=True)
    ]
    return run


def row(name: str, run: Run) -> str:
    def ms(values: list[float], q: float) -> str:
        return f"{percentile(values, q) * 1000:.0f}" if values else "-"

    done = len(run.latency)
    first = run.prompt_tokens[0] / sum(run.prompt_tokens) if sum(run.prompt_tokens) else 0.0
    return (
        f"| {name} | {done} | {run.errors} | {run.hit_rate:.1%} | {first:.0%} | "
        f"{run.split_groups} | {run.late_misses} | "
        f"{ms(run.ttft, 50)} | "
        f"{ms(run.ttft, 90)} | {ms(run.latency, 50)} | {ms(run.latency, 90)} | "
        f"{done / run.seconds if run.seconds else 0:.1f} |"
    )


def goal(runs: dict[str, Run]) -> str:
    ours, smg = runs.get("pd-router cache_aware"), runs.get("smg cache_aware")
    if ours is None or smg is None or not ours.ttft or not smg.ttft:
        return "Goal not checked: pd-router cache_aware and smg cache_aware did not both run."
    hit = ours.hit_rate >= smg.hit_rate
    ttft = percentile(ours.ttft, 50) <= percentile(smg.ttft, 50)
    return (
        f"Goal: hit rate at least smg's: {'met' if hit else 'NOT met'} "
        f"({ours.hit_rate:.2%} vs {smg.hit_rate:.2%}); TTFT p50 no worse: "
        f"{'met' if ttft else 'NOT met'} ({percentile(ours.ttft, 50) * 1000:.1f} ms vs "
        f"{percentile(smg.ttft, 50) * 1000:.1f} ms)."
    )


def report(cfg: Config, runs: dict[str, Run], skipped: dict[str, str], command: str) -> str:
    requests = cfg.groups * cfg.prompts_per_group
    lines = [
        f"# Cache-aware routing ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {repo_revision()})",
        "",
        f"`{command}`",
        "",
        f"{cfg.rounds} round(s) of {requests} requests: {cfg.groups} groups x "
        f"{cfg.prompts_per_group}, system prompt "
        f"{cfg.system_len} tokens + question {cfg.question_len}, {cfg.output_len} output "
        f"tokens, concurrency {cfg.concurrency}, seed {cfg.seed}. 2P2D pd_worker, profile "
        f"h100-8b, speed {cfg.speed:g}, KV capacity {cfg.kv_tokens} tokens per worker. "
        "Times are wall clock at that speed; rounds are pooled, the order of the "
        "configurations rotates each round.",
        "",
        "| configuration | ok | errors | prefix-cache hit rate | prompt tokens to prefill 1 "
        f"| groups on both prefills (of {cfg.groups * cfg.rounds}) | misses after a group's "
        "first | TTFT p50 ms | TTFT p90 ms | latency p50 ms | latency p90 ms | req/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(row(name, run) for name, run in runs.items()),
        "",
        goal(runs),
    ]
    for name, why in skipped.items():
        lines.append(f"\n{name} did not run: {why}")
    for name, run in runs.items():
        if run.first_error:
            lines.append(f"\n{name}: first error: {run.first_error}")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=2048, help="system prompt tokens")
    p.add_argument("--question-len", type=int, default=128, help="question tokens")
    p.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kv-tokens", type=int, default=48000, help="KV capacity of each worker")
    p.add_argument("--speed", type=float, default=1.0, help="timing model speed (1: real time)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--rounds", type=int, default=2, help="each configuration this many times")
    p.add_argument(
        "--only", default="", help=f"comma-separated subset of: {', '.join(CONFIGURATIONS)}"
    )
    args = p.parse_args(argv)
    only = tuple(n.strip() for n in args.only.split(",") if n.strip())
    unknown = [n for n in only if n not in CONFIGURATIONS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGURATIONS)}")
    return Config(
        groups=args.groups,
        prompts_per_group=args.prompts_per_group,
        system_len=args.system_len,
        question_len=args.question_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        kv_tokens=args.kv_tokens,
        speed=args.speed,
        seed=args.seed,
        rounds=args.rounds,
        only=only or tuple(CONFIGURATIONS),
    )


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    command = shlex.join(["bench/cache_aware.py", *(sys.argv[1:] if argv is None else argv)])
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = RESULTS / f"cache-aware-{stamp}"
    logs.mkdir(parents=True, exist_ok=True)
    prompts = workload(cfg)
    runs: dict[str, Run] = {}
    skipped: dict[str, str] = {}
    cluster = WorkerCluster(
        2,
        2,
        speed=cfg.speed,
        profile="h100-8b",
        enable_faults=False,
        max_total_num_tokens=cfg.kv_tokens,
    )
    with cluster:
        for turn in range(cfg.rounds):
            shift = turn % len(cfg.only)
            for name in cfg.only[shift:] + cfg.only[:shift]:
                if name in skipped:
                    continue
                peer = CONFIGURATIONS[name]
                try:
                    ensure_peer(peer)
                    check_peer(peer)
                    print(f"# round {turn + 1}: {name} ...", file=sys.stderr)
                    run = measure(peer, cluster, prompts, cfg, logs)
                except (PeerSetupError, RouterStartError) as exc:
                    skipped[name] = str(exc).splitlines()[0]
                    continue
                runs.setdefault(name, Run()).add(run)
    text = report(cfg, runs, skipped, command)
    print(text)
    (RESULTS / f"cache-aware-{stamp}.md").write_text(text)
    failed = any(
        n.startswith("pd-router") and (n in skipped or n not in runs or runs[n].errors)
        for n in cfg.only
    )
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
