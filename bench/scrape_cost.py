"""What one ``/metrics`` scrape costs with N data-plane processes: the control process asks
every data plane for its samples and adds them to its own (docs/router.md, "Processes").

For each ``--processes`` count it starts pd-router (its own processes, from a TOML config) over
a 1P1D reference cluster (speed 0), sends ``--requests`` requests so every process has series
to report, then times ``--scrapes`` scrapes one after another and reports their latency
(p50/p90/max), the exposition's size and the CPU time the router's processes spent per scrape.

    .venv/bin/python bench/scrape_cost.py --processes 1,6
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from router_process import running_router  # noqa: E402

from pd_worker.cluster import WorkerCluster  # noqa: E402


def tree_cpu_secs(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (utime + stime, from /proc)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids += [int(child) for child in f.read().split()]
    for one in pids:
        with open(f"/proc/{one}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def router_pid(port: int) -> int:
    """The process listening on ``port`` that has no listening parent: the router's first."""
    target = f":{port:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                parts = line.split()
                if parts[1].endswith(target) and parts[3] == "0A":
                    inodes.add(parts[9])
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    found.append(int(pid))
                    break
        except OSError:
            continue
    return min(found)


async def traffic(url: str, requests: int) -> None:
    body = {"text": "scrape", "sampling_params": {"max_new_tokens": 2}}
    for _ in range(requests):
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            (await http.post("/generate", json=body)).raise_for_status()


def measure(url: str, pid: int, scrapes: int) -> tuple[list[float], int, float]:
    latencies = []
    size = 0
    cpu_before = tree_cpu_secs(pid)
    with httpx.Client(base_url=url, timeout=10.0) as http:
        for _ in range(scrapes):
            started = time.perf_counter()
            response = http.get("/metrics")
            latencies.append(time.perf_counter() - started)
            response.raise_for_status()
            size = len(response.content)
    return latencies, size, (tree_cpu_secs(pid) - cpu_before) / scrapes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", default="1,6")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args()
    print(f"{args.scrapes} scrapes after {args.requests} requests, {os.cpu_count()} cores")
    print("| data planes | scrape p50 ms | p90 ms | max ms | router CPU ms per scrape | bytes |")
    print("|---:|---:|---:|---:|---:|---:|")
    with WorkerCluster(prefill=1, decode=1, speed=0.0) as cluster:
        for processes in (int(n) for n in args.processes.split(",")):
            with running_router(cluster, drain_timeout_secs=30.0, processes=processes) as url:
                asyncio.run(traffic(url, args.requests))
                pid = router_pid(int(url.rsplit(":", 1)[1]))
                latencies, size, cpu = measure(url, pid, args.scrapes)
            ms = sorted(1000 * v for v in latencies)
            print(f"| {processes} | {ms[len(ms) // 2]:.2f} | {ms[int(len(ms) * 0.9)]:.2f} | "
                  f"{ms[-1]:.2f} | {1000 * cpu:.2f} | {size} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
