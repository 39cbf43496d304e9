"""Requests per second one reference worker process serves at speed 0 (no modeled delays).

Router benchmarks use pd_worker as their backend; this shows the backend is not their bottleneck.
Three closed-loop scenarios, each for a fixed duration with a fixed number of concurrent clients:

- ``decode``: one decode process, non-streaming /generate without KV transfer.
- ``decode-stream``: the same, streaming (one SSE event per token).
- ``pd-pair``: one prefill and one decode process, each request sent to both with a bootstrap
  room, the decode pulling the KV over the prefill's bootstrap connection (pairs per second).

The load generator runs in this process and shares the machine's cores with the workers, so the
figures are a lower bound. ``worker_cpu_ms`` is the CPU the worker processes (both, for pd-pair)
spent per request, read from /proc: the cost a router benchmark's backend adds per request.

    .venv/bin/python bench/worker_throughput.py [--duration 5] [--concurrency 32]
                                                [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable

import aiohttp
from proc_cpu import tree_cpu_seconds

from pd_worker.cluster import WorkerCluster

Send = Callable[[aiohttp.ClientSession, int], Awaitable[bool]]


async def closed_loop(send: Send, concurrency: int, duration: float) -> dict[str, float]:
    """Run ``concurrency`` clients back to back for ``duration`` seconds; count outcomes."""
    ok = failed = 0
    deadline = time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(index: int) -> None:
            nonlocal ok, failed
            n = 0
            while time.monotonic() < deadline:
                if await send(session, index * 1_000_000 + n):
                    ok += 1
                else:
                    failed += 1
                n += 1

        started = time.monotonic()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        elapsed = time.monotonic() - started
    return {
        "requests": ok,
        "failed": failed,
        "seconds": round(elapsed, 2),
        "rps": round(ok / elapsed, 1),
    }


def decode_sender(url: str, max_new_tokens: int, stream: bool) -> Send:
    async def send(session: aiohttp.ClientSession, n: int) -> bool:
        body = {
            "text": f"bench prompt {n}",
            "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens},
        }
        async with session.post(url + "/generate", json=body) as response:
            await response.read()
            return response.status == 200

    return send


def pair_sender(prefill: str, decode: str, bootstrap_port: int, max_new_tokens: int) -> Send:
    async def send(session: aiohttp.ClientSession, n: int) -> bool:
        body = {
            "text": f"bench prompt {n}",
            "sampling_params": {"max_new_tokens": max_new_tokens},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }

        async def post(url: str) -> int:
            async with session.post(url + "/generate", json=body) as response:
                await response.read()
                return response.status

        statuses = await asyncio.gather(post(prefill), post(decode))
        return statuses == [200, 200]

    return send


def workers_cpu_seconds(cluster: WorkerCluster) -> float:
    """CPU seconds used so far by all the cluster's worker processes."""
    return sum(tree_cpu_seconds(cluster.worker(url).process.pid) for url in cluster.urls)


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    async with WorkerCluster(prefill=1, decode=1, speed=0.0) as cluster:
        prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
        scenarios = {
            "decode": decode_sender(decode, args.max_new_tokens, stream=False),
            "decode-stream": decode_sender(decode, args.max_new_tokens, stream=True),
            "pd-pair": pair_sender(
                prefill, decode, cluster.bootstrap_port(prefill), args.max_new_tokens
            ),
        }
        for name, send in scenarios.items():
            cpu_before = workers_cpu_seconds(cluster)
            result = await closed_loop(send, args.concurrency, args.duration)
            cpu_ms = (workers_cpu_seconds(cluster) - cpu_before) * 1000
            result["worker_cpu_ms"] = round(cpu_ms / max(result["requests"], 1), 3)
            results[name] = result
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per scenario")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    setup = f"cores={os.cpu_count()} concurrency={args.concurrency}"
    print(f"{setup} max_new_tokens={args.max_new_tokens}")
    print(f"{'scenario':15s} {'req/s':>8s} {'ok':>8s} {'failed':>7s} {'worker_cpu_ms':>14s}")
    for name, r in results.items():
        print(
            f"{name:15s} {r['rps']:8.1f} {r['requests']:8d} {r['failed']:7d}"
            f" {r['worker_cpu_ms']:14.3f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
