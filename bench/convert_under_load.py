"""Conversion soak: flip servers between prefill and decode while clients keep sending.

A 2P2D reference cluster (pd_worker processes) sits behind pd-router (its own process, started
from a TOML config); this process runs ``--concurrency`` closed-loop clients (half streaming,
half not, every reply checked against the text the decode must produce) and, at the same time,
converts workers back and forth through ``POST /convert_pd_role`` (a prefill to decode, then a
decode to prefill, ...) until ``--flips`` conversions have succeeded.

With ``--replicas N`` it starts a single-member etcd (``--etcd-binary``, default ``etcd`` on
PATH) and N pd-router processes that join one cluster on it (a ``[cluster]`` section in each
config); the clients are spread over the replicas (client i sends to replica i mod N) and the
conversions go through the replicas in turn, so every conversion drains a worker that the other
replicas are routing to. It reports:

- requests sent and failed (the goal is 0 failed);
- drain, worker switch, verify and total time per conversion (p50/p90/p99/max);
- the router's own overhead per conversion: total - drain - the worker's switch call (goal:
  p99 < 20 ms);
- the delay from the last in-flight request ending to the switch call (goal: p99 < 50 ms;
  mini_lb polls its switch once a second).

    .venv/bin/python bench/convert_under_load.py                 # 2P2D, 32 clients, 120 flips
    .venv/bin/python bench/convert_under_load.py --native        # workers without extensions
    .venv/bin/python bench/convert_under_load.py --replicas 3 --flips 100   # 3 routers on etcd
    .venv/bin/python bench/convert_under_load.py --router-workers 4   # 1 control + 4 data planes

Exit status 1 if a request failed, a conversion did not succeed or a goal was missed (with
``--replicas``, the two latency goals are reported but not judged: they are a single router's).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from etcd_process import running_etcd  # noqa: E402
from router_process import cluster_toml, running_router, wait_replicas  # noqa: E402

from pd_worker.cluster import WorkerCluster  # noqa: E402
from pd_worker.tokens import expected_text  # noqa: E402

OVERHEAD_GOAL_S = 0.020
IDLE_TO_SWITCH_GOAL_S = 0.050
MAX_BENCH_SECS = 600.0
WARM_UP_TIMEOUT_SECS = 30.0
DRAIN_TIMEOUT_SECS = 60.0
CLUSTER_NAME = "bench"
# The latency goals are the single router's: a replica's conversion also waits for etcd (its
# SWITCHING mark and its outcome are transactions, the peers' drain reports come through the
# watch), so with --replicas they are reported and the run is judged on failures alone.
REPLICA_GOALS_NOTE = "(single-router goals, reported only with replicas)"


@dataclass
class Load:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @classmethod
    def total(cls, loads: list[Load]) -> Load:
        """The sum of the loads sent to each replica."""
        return cls(
            sent=sum(load.sent for load in loads),
            ok=sum(load.ok for load in loads),
            failed=sum(load.failed for load in loads),
            errors=[error for load in loads for error in load.errors],
        )


# --- load -----------------------------------------------------------------------------------


async def client_loop(
    session: aiohttp.ClientSession, url: str, load: Load, stop: asyncio.Event, tokens: int
) -> None:
    ids = itertools.count()
    while not stop.is_set():
        n = next(ids)
        prompt = f"soak {id(load) % 997} {n} {time.monotonic_ns() % 100000}"
        stream = n % 2 == 0
        body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens}, "stream": stream}
        load.sent += 1
        error = await one_request(session, url, body, prompt, tokens, stream)
        if error is None:
            load.ok += 1
        else:
            load.failed += 1
            load.errors.append(error)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    prompt: str,
    tokens: int,
    stream: bool,
) -> str | None:
    try:
        async with session.post(url + "/generate", data=orjson.dumps(body)) as response:
            raw = await response.read()
            if response.status != 200:
                return f"HTTP {response.status}: {raw[:200]!r}"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    expected = expected_text(prompt, tokens)
    if not stream:
        return None if orjson.loads(raw).get("text") == expected else f"wrong text {raw[:200]!r}"
    events = [b[5:].strip() for b in raw.split(b"\n\n") if b.strip().startswith(b"data:")]
    if len(events) < 2 or events[-1] != b"[DONE]":
        return f"stream not ended with [DONE]: {raw[-200:]!r}"
    if orjson.loads(events[-2]).get("text") != expected:
        return f"wrong streamed text {events[-2][:200]!r}"
    return None


# --- conversions ----------------------------------------------------------------------------


async def flip_loop(
    session: aiohttp.ClientSession, urls: list[str], flips: int, records: list[dict]
) -> list[str]:
    """Alternate: one prefill -> decode, then one decode -> prefill, until ``flips`` succeeded;
    each attempt goes through the next router of ``urls`` (one, or the replicas in turn)."""
    problems: list[str] = []
    roles = itertools.cycle(("prefill", "decode"))
    attempts = 0
    while len(records) < flips and attempts < flips * 2:
        url = urls[attempts % len(urls)]
        attempts += 1
        source = next(roles)
        async with session.get(url + "/workers") as response:
            workers = (await response.json())["workers"]
        candidates = [w["url"] for w in workers if w["role"] == source and w["state"] == "active"]
        body = {"server_url": candidates[attempts % len(candidates)]}
        async with session.post(url + "/convert_pd_role", data=orjson.dumps(body)) as response:
            record = await response.json()
        if response.status != 200:
            problems.append(f"conversion HTTP {response.status}: {str(record)[:300]}")
            continue
        records.append(record)
    return problems


# --- report ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def row(name: str, values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    cells = [percentile(ms, q) for q in (50, 90, 99)] + [max(ms)]
    return f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |"


def report(
    loads: list[Load], records: list[dict], elapsed: float, args: argparse.Namespace
) -> bool:
    load = Load.total(loads)
    if not records:
        print(f"no conversion succeeded; requests sent: {load.sent}, failed: {load.failed}")
        return False
    for r in records:
        r["timings"]["overhead_without_verify_s"] = (
            r["timings"]["router_overhead_s"] - r["timings"]["verify_s"]
        )
    timings = {
        key: [r["timings"][key] for r in records]
        for key in (
            "drain_s",
            "worker_switch_s",
            "verify_s",
            "total_s",
            "router_overhead_s",
            "overhead_without_verify_s",
            "idle_to_switch_s",
        )
    }
    overhead_p99 = percentile(timings["router_overhead_s"], 99)
    idle_p99 = percentile(timings["idle_to_switch_s"], 99)
    directions = {}
    for r in records:
        key = f"{r['from_role']}->{r['to_role']}"
        directions[key] = directions.get(key, 0) + 1
    by_direction = ", ".join(f"{k} {v}" for k, v in directions.items())
    switch_calls = sum(
        1 for r in records for reply in r["worker_replies"] if reply["call"] != "verify"
    )
    routers = (
        f"{args.replicas} pd-router replicas on etcd (clients and conversions spread over them)"
        if args.replicas
        else "one pd-router"
    )
    lines = [
        f"2P2D reference cluster (speed {args.speed}, {args.protocol} protocol) behind {routers}, "
        f"concurrency {args.concurrency} (half streaming), {args.tokens} tokens per request, "
        f"{elapsed:.1f} s, load average {args.load_before:.1f} before / "
        f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs",
        "",
        f"requests sent: {load.sent}, ok: {load.ok}, failed: {load.failed}",
    ]
    if len(loads) > 1:
        lines.append(
            "per replica (sent / failed): "
            + ", ".join(f"{each.sent} / {each.failed}" for each in loads)
        )
    lines += [
        f"conversions succeeded: {len(records)} ({by_direction}); switch calls: {switch_calls} "
        "(a native switch refused as not idle is called again)",
        "",
        "| per conversion (ms) | p50 | p90 | p99 | max |",
        "|---|---|---|---|---|",
        row("drain", timings["drain_s"]),
        row("worker switch call", timings["worker_switch_s"]),
        row("verify", timings["verify_s"]),
        row("total", timings["total_s"]),
        row("router overhead (total - drain - worker switch)", timings["router_overhead_s"]),
        row("router overhead without the verify round trip", timings["overhead_without_verify_s"]),
        row("last in-flight request done -> switch call", timings["idle_to_switch_s"]),
        "",
        f"goals: router overhead p99 {overhead_p99 * 1000:.2f} ms (< {OVERHEAD_GOAL_S * 1000:.0f}),"
        f" idle->switch p99 {idle_p99 * 1000:.2f} ms (< {IDLE_TO_SWITCH_GOAL_S * 1000:.0f})"
        + (f" {REPLICA_GOALS_NOTE}" if args.replicas else ""),
    ]
    print("\n".join(lines))
    for error in load.errors[:5]:
        print("error:", error)
    timing_goals_met = overhead_p99 < OVERHEAD_GOAL_S and idle_p99 < IDLE_TO_SWITCH_GOAL_S
    return (
        load.failed == 0
        and len(records) >= args.flips
        and (timing_goals_met or bool(args.replicas))
    )


# --- main -----------------------------------------------------------------------------------


async def warmed_up(load: Load, clients: int) -> None:
    """Return once as many requests have succeeded as there are clients (every client is past
    its first connection), polling every 10 ms for at most WARM_UP_TIMEOUT_SECS."""
    deadline = time.monotonic() + WARM_UP_TIMEOUT_SECS
    while load.ok < clients:
        if time.monotonic() > deadline:
            raise SystemExit(f"warm-up: {load.ok} of {clients} requests done in time")
        await asyncio.sleep(0.01)


async def all_warmed_up(loads: list[Load], clients: int) -> None:
    """Every router has answered as many requests as clients send to it."""
    await asyncio.gather(
        *(warmed_up(load, len(range(i, clients, len(loads)))) for i, load in enumerate(loads))
    )


async def soak(
    urls: list[str], args: argparse.Namespace
) -> tuple[list[Load], list[dict], float, list[str]]:
    """Client i sends to ``urls[i % len(urls)]`` (one Load per router) while the conversions
    go through the routers in turn."""
    loads = [Load() for _ in urls]
    stop = asyncio.Event()
    records: list[dict] = []
    connector = aiohttp.TCPConnector(limit=args.concurrency + 8)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        clients = [
            asyncio.create_task(
                client_loop(session, urls[i % len(urls)], loads[i % len(urls)], stop, args.tokens)
            )
            for i in range(args.concurrency)
        ]
        started = time.monotonic()
        try:
            await all_warmed_up(loads, args.concurrency)
            problems = await asyncio.wait_for(
                flip_loop(session, urls, args.flips, records), MAX_BENCH_SECS
            )
        finally:
            stop.set()
            await asyncio.gather(*clients)
        return loads, records, time.monotonic() - started, problems


def start_routers(
    cluster: WorkerCluster, args: argparse.Namespace, stack: contextlib.ExitStack
) -> list[str]:
    """One router, or etcd and ``args.replicas`` routers on one cluster; their urls."""
    processes = args.router_workers
    if not args.replicas:
        return [
            stack.enter_context(
                running_router(cluster, drain_timeout_secs=DRAIN_TIMEOUT_SECS, processes=processes)
            )
        ]
    etcd_url = stack.enter_context(running_etcd(args.etcd_binary))
    extra = cluster_toml(etcd_url, CLUSTER_NAME)
    urls = [
        stack.enter_context(
            running_router(
                cluster, drain_timeout_secs=DRAIN_TIMEOUT_SECS, extra=extra, processes=processes
            )
        )
        for _ in range(args.replicas)
    ]
    wait_replicas(urls)
    return urls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flips", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--speed", type=float, default=0.05)
    parser.add_argument("--native", action="store_true", help="hide the extension routes")
    parser.add_argument(
        "--replicas", type=int, default=0, help="N pd-router replicas on one etcd cluster"
    )
    parser.add_argument("--etcd-binary", default="etcd", help="etcd for --replicas")
    parser.add_argument(
        "--router-workers", type=int, default=1, help="data-plane processes of each router"
    )
    args = parser.parse_args()
    if args.replicas < 0:
        parser.error("--replicas takes N >= 1 (0, the default: one router without etcd)")
    args.protocol = "native" if args.native else "extension"
    args.load_before = os.getloadavg()[0]
    with WorkerCluster(prefill=2, decode=2, speed=args.speed) as cluster:
        if args.native:
            for worker_url in cluster.urls:
                httpx.post(worker_url + "/fault", json={"native_only": True}).raise_for_status()
        with contextlib.ExitStack() as stack:
            urls = start_routers(cluster, args, stack)
            loads, records, elapsed, problems = asyncio.run(soak(urls, args))
    for problem in problems[:5]:
        print("conversion problem:", problem)
    return 0 if report(loads, records, elapsed, args) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
