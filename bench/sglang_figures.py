"""Figures of pd-router in front of real SGLang 0.5.23 on the CPU (docs/PERFORMANCE.md, "Real
SGLang on the CPU"), in one run.

Starts a 2P2D of real SGLang servers (tests/sglang_cluster.py: the second prefill p1 and decode
d1 through server_patch) and a pd-router process in front of it, then measures:

1. Router overhead per request: the same greedy ``/generate`` requests sent directly by this
   script to a prefill and a decode (both legs at once with ``bootstrap_host``/``bootstrap_port``/
   ``bootstrap_room``, as a minimal router does; the answer is the decode's body, the pair rotating
   over the four) and through pd-router, interleaved batch by batch (the order of the two paths
   alternating) so that the noise of a shared machine hits both alike, at each concurrency.
2. Conversion phases under load: clients send greedy requests through the router while both
   decodes go decode -> prefill -> decode ``--round-trips`` times in turn (d1 through the
   extension protocol, d0 through SGLang's native one) and p1 prefill -> decode -> prefill
   ``--prefill-round-trips`` times, through ``POST /convert_pd_role`` (:func:`conversion_plan`
   says why in that order); each conversion's timings are read from ``GET /conversions/{id}``.

Prints a markdown report and writes it, with the raw figures, under bench/results/. Absolute
times are those of a tiny model on a shared CPU: the ratios are what carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.cli_process import serving  # noqa: E402
from tests.sglang_cluster import (  # noqa: E402
    NO_RADIX,
    SGLangServer,
    missing,
    pd_args,
    router_ready,
    running,
    server,
)

PROMPTS = (
    "The prefill computes the prompt's KV cache",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "and the decode receives it over mooncake",
)
GREEDY = {"temperature": 0, "max_new_tokens": 8}
TIMEOUT_SECS = 180.0
CONVERT_TIMEOUT_SECS = 300.0
ROUTER_FLAGS = ("--host", "127.0.0.1", "--health-check-interval-secs", "1",
                "--rendezvous-timeout-secs", "15")  # fmt: skip
PHASES = ("drain_s", "switch_s", "worker_switch_s", "verify_s", "canary_s", "total_s")


class RequestFailed(Exception):
    """A worker or the router answered a request with something other than 200."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3, help="clients during conversions")
    parser.add_argument("--round-trips", type=int, default=3, help="d1, d0: D -> P -> D, times")
    parser.add_argument("--prefill-round-trips", type=int, default=1, help="p1: P -> D -> P")
    parser.add_argument("--requests", type=int, default=60, help="per path and concurrency")
    parser.add_argument("--concurrency", default="1,4", help="overhead concurrencies, commas")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    return parser.parse_args(argv)


# --- statistics and report (pure) ------------------------------------------------------------


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """Count, mean, p50 and p90 in milliseconds (inclusive quantiles: p90 of ten values lies
    between the ninth and the tenth)."""
    ms = [s * 1000.0 for s in seconds]
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": deciles[8],
    }


def overhead_figures(
    direct: Sequence[Sequence[float]], routed: Sequence[Sequence[float]]
) -> dict[str, Any]:
    """Both paths' summaries and router/direct for each statistic, from batches of latencies
    where the i-th batch of each path ran next to the other. ``paired`` is the median and the
    quartiles of the per-batch ratios (router batch mean / direct batch mean): load that comes
    and goes over seconds shifts both batches of a pair alike and cancels there, where it only
    spreads the pooled figures."""
    a = latency_summary([x for batch in direct for x in batch])
    b = latency_summary([x for batch in routed for x in batch])
    ratios = {k[:-3]: b[k] / a[k] for k in ("mean_ms", "p50_ms", "p90_ms")}
    per_batch = [
        statistics.fmean(r) / statistics.fmean(d) for d, r in zip(direct, routed, strict=True)
    ]
    q1, median, q3 = statistics.quantiles(per_batch, n=4, method="inclusive")
    return {"direct": a, "router": b, "ratio": ratios | {"paired": [median, q1, q3]}}


def conversion_rows(conversions: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per worker and direction (in order of first appearance): how many, and the median and
    max of each phase over the succeeded ones."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in conversions:
        groups.setdefault((c["worker"], c["direction"]), []).append(c)
    rows = []
    for (worker, direction), items in groups.items():
        ok = [c["timings"] for c in items if c["status"] == "succeeded"]
        phases = {
            name: {"median": statistics.median(vs), "max": max(vs)}
            for name in PHASES
            if (vs := [t[name] for t in ok if name in t])
        }
        row = {"worker": worker, "direction": direction, "n": len(items), "succeeded": len(ok)}
        rows.append(row | {"phases": phases})
    return rows


def _cell(phases: dict[str, dict[str, float]], name: str) -> str:
    if name not in phases:
        return "-"
    return f"{phases[name]['median']:.2f} / {phases[name]['max']:.2f}"


def markdown(report: dict[str, Any]) -> str:
    """The report as docs/PERFORMANCE.md shows it: the overhead table, then the conversions."""
    lines = [
        f"Real SGLang {report['sglang']} on the CPU, {report['date']} (commit {report['commit']}), "
        f"load average {report['loadavg_start']:.1f} at start, {report['loadavg_end']:.1f} at end",
        "",
        f"Router overhead per request (greedy /generate, {GREEDY['max_new_tokens']} new tokens, "
        "direct = both legs sent by the benchmark):",
        "",
        "| concurrency | path | requests | mean ms | p50 ms | p90 ms | paired batches "
        "(median, quartiles) |",
        "|---|---|---|---|---|---|---|",
    ]
    for concurrency, figures in report["overhead"].items():
        for path in ("direct", "router"):
            s = figures[path]
            lines.append(
                f"| {concurrency} | {path} | {s['n']} | {s['mean_ms']:.1f} | {s['p50_ms']:.1f} "
                f"| {s['p90_ms']:.1f} | |"
            )
        r = figures["ratio"]
        median, q1, q3 = r["paired"]
        lines.append(
            f"| {concurrency} | **router / direct** | | **{r['mean']:.2f}** | **{r['p50']:.2f}** "
            f"| **{r['p90']:.2f}** | **{median:.2f}** ({q1:.2f}-{q3:.2f}) |"
        )
    lines += [
        "",
        f"Answers different between the two paths: {report['different_answers']}.",
        "",
        f"Conversions under load ({report['clients']} clients), seconds, median / max:",
        "",
        "| worker | direction | n (ok) | drain | switch | worker switch | verify (incl. canary) "
        "| canary | total |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["conversion_rows"]:
        cells = [_cell(row["phases"], name) for name in PHASES]
        lines.append(
            f"| {row['worker']} | {row['direction']} | {row['n']} ({row['succeeded']}) | "
            + " | ".join(cells)
            + " |"
        )
    traffic = report["traffic"]
    lines += [
        "",
        f"Requests during the conversions: {traffic['sent']} sent, {traffic['failed']} failed"
        + (f" (first: {traffic['failures'][0]})" if traffic["failures"] else "")
        + ".",
    ]
    return "\n".join(lines) + "\n"


# --- router overhead ---------------------------------------------------------------------------


async def post_generate(session: aiohttp.ClientSession, url: str, body: dict) -> dict[str, Any]:
    async with session.post(url + "/generate", json=body) as reply:
        if reply.status != 200:
            raise RequestFailed(f"{url}: {reply.status} {(await reply.text())[:200]}")
        return await reply.json()


@dataclass
class Paths:
    """The two ways one request is sent: straight to a prefill and a decode, or via pd-router."""

    session: aiohttp.ClientSession
    router_url: str
    pairs: list[tuple[SGLangServer, SGLangServer]]
    turn: int = 0

    async def direct(self, body: dict[str, Any]) -> dict[str, Any]:
        """Both legs at once, as a minimal router sends them; the decode's body is the answer."""
        prefill, decode = self.pairs[self.turn % len(self.pairs)]
        self.turn += 1
        legs = body | {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }
        _, answer = await asyncio.gather(
            post_generate(self.session, prefill.url, legs),
            post_generate(self.session, decode.url, legs),
        )
        return answer

    async def router(self, body: dict[str, Any]) -> dict[str, Any]:
        return await post_generate(self.session, self.router_url, body)


async def timed(
    send: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]], prompt: str
) -> tuple[float, list[int]]:
    started = time.perf_counter()
    answer = await send({"text": prompt, "sampling_params": GREEDY})
    return time.perf_counter() - started, answer["output_ids"]


async def measure_overhead(
    router_url: str, pairs: list[tuple[SGLangServer, SGLangServer]], args: argparse.Namespace
) -> tuple[dict[str, Any], int]:
    """Per concurrency, both paths' latencies, batch by batch with the order alternating; and
    how many answers differed from the other path's for the same prompt."""
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECS)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        paths = Paths(session, router_url, pairs)
        for prompt in PROMPTS * 2:  # every pair's mooncake handshake before the clock starts
            await timed(paths.direct, prompt)
            await timed(paths.router, prompt)
        figures: dict[str, Any] = {}
        answers: dict[str, set[tuple[int, ...]]] = {p: set() for p in PROMPTS}
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            batches: dict[str, list[list[float]]] = {"direct": [], "router": []}
            for batch in range(args.requests // concurrency):
                order = ("direct", "router") if batch % 2 == 0 else ("router", "direct")
                prompts = [PROMPTS[(batch + i) % len(PROMPTS)] for i in range(concurrency)]
                for name in order:
                    send = getattr(paths, name)
                    results = await asyncio.gather(*(timed(send, p) for p in prompts))
                    batches[name].append([took for took, _ in results])
                    for prompt, (_, ids) in zip(prompts, results, strict=True):
                        answers[prompt].add(tuple(ids))
            figures[str(concurrency)] = overhead_figures(batches["direct"], batches["router"])
            ratio = figures[str(concurrency)]["ratio"]
            print(f"   concurrency {concurrency}: router/direct mean {ratio['mean']:.2f}, "
                  f"paired median {ratio['paired'][0]:.2f}", flush=True)  # fmt: skip
    different = sum(len(ids) - 1 for ids in answers.values())
    return figures, different


# --- conversions under load --------------------------------------------------------------------


@dataclass
class Traffic:
    """Clients sending greedy /generate requests through the router until stopped."""

    url: str
    clients: int
    stop: threading.Event = field(default_factory=threading.Event)
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, index: int) -> None:
        with httpx.Client(timeout=TIMEOUT_SECS) as http:
            n = index
            while not self.stop.is_set():
                body = {"text": PROMPTS[n % len(PROMPTS)], "sampling_params": GREEDY}
                n += 1
                try:
                    reply = http.post(self.url + "/generate", json=body)
                    failure = None
                    if reply.status_code != 200:
                        failure = f"{reply.status_code}: {reply.text[:200]}"
                except httpx.HTTPError as exc:
                    failure = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    self.sent += 1
                    if failure:
                        self.failures.append(failure)

    def __enter__(self) -> Traffic:
        self.threads = [
            threading.Thread(target=self.client, args=(i,), daemon=True)
            for i in range(self.clients)
        ]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(TIMEOUT_SECS)


def convert(router_url: str, worker: SGLangServer, role: str) -> dict[str, Any]:
    """One conversion through ``POST /convert_pd_role`` (waiting for its end) and the router's
    record of it, read back from ``GET /conversions/{id}``."""
    body = {"server_url": worker.url, "new_role": role}
    reply = httpx.post(router_url + "/convert_pd_role", json=body, timeout=CONVERT_TIMEOUT_SECS)
    if "id" not in (answer := reply.json()):
        print(f"   {worker.name} -> {role}: refused, {reply.status_code} {reply.text[:300]}")
        return {"worker": worker.name, "direction": f"-> {role}", "status": "refused",
                "message": reply.text[:300], "timings": {}}  # fmt: skip
    record = httpx.get(f"{router_url}/conversions/{answer['id']}", timeout=10.0).json()
    timings = record["timings"]
    print(f"   {worker.name} {record['from_role']} -> {role}: {record['status']}, "
          + ", ".join(f"{k[:-2]} {timings[k]:.2f} s" for k in PHASES if k in timings),
          flush=True)  # fmt: skip
    outcome = {
        "worker": worker.name,
        "direction": f"{record['from_role']} -> {role}",
        "status": record["status"],
        "message": record["message"],
        "timings": timings,
    }
    if record["status"] != "succeeded":
        print(f"   {record['message']}", flush=True)
        outcome["worker_replies"] = record["worker_replies"]
    return outcome


def conversion_plan(
    fleet: Sequence[SGLangServer], round_trips: int, prefill_round_trips: int
) -> list[tuple[SGLangServer, str]]:
    """Round trips that SGLang 0.5.23's stale-endpoint bug (docs/sglang-bugs.md, b) leaves
    clean: a server that becomes a prefill again is only ever met by decodes that switched
    since they last talked to it, or that run server_patch and forget its old endpoints when
    the router asks. d0 runs plain SGLang and cannot be asked, so it switches between two
    prefill stints of d1 or p1; d1, patched, forgets d0's old endpoints."""
    _, p1, d0, d1 = fleet
    decodes = [(d1, "prefill"), (d1, "decode"), (d0, "prefill"), (d0, "decode")]
    prefill = [(p1, "decode"), (d0, "prefill"), (d0, "decode"), (p1, "prefill")]
    return decodes * round_trips + prefill * prefill_round_trips


def run_conversions(
    router_url: str, plan: list[tuple[SGLangServer, str]], clients: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The plan's conversions one after the other while ``clients`` send; stops at the first
    that does not succeed (the pools would no longer be the plan's)."""
    conversions = []
    with Traffic(router_url, clients) as traffic:
        time.sleep(1.0)
        for worker, role in plan:
            conversions.append(convert(router_url, worker, role))
            if conversions[-1]["status"] != "succeeded":
                break
            time.sleep(1.0)  # traffic through the new pools before the next one
    summary = {"sent": traffic.sent, "failed": len(traffic.failures),
               "failures": traffic.failures[:5]}  # fmt: skip
    return conversions, summary


# --- the run -----------------------------------------------------------------------------------


def commit() -> str:
    """The checkout's commit, with ``+dirty`` for uncommitted changes; ``unknown`` outside git
    (a ``git archive`` export)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "-uno") else "")


def measure(fleet: list[SGLangServer], args: argparse.Namespace) -> dict[str, Any]:
    p0, p1, d0, d1 = fleet
    report: dict[str, Any] = {}
    with serving(*pd_args([p0, p1], [d0, d1]), *ROUTER_FLAGS) as router:
        router_ready(router.url, prefill=2, decode=2)
        print("-- router overhead: direct to a prefill and a decode vs through pd-router")
        started = time.monotonic()
        pairs = [(p, d) for p in (p0, p1) for d in (d0, d1)]
        overhead, different = asyncio.run(measure_overhead(router.url, pairs, args))
        report |= {"overhead": overhead, "different_answers": different}
        report["overhead_s"] = time.monotonic() - started
        print(f"-- conversions while {args.clients} clients send")
        started = time.monotonic()
        plan = conversion_plan(fleet, args.round_trips, args.prefill_round_trips)
        conversions, traffic = run_conversions(router.url, plan, args.clients)
        report |= {"conversions": conversions, "traffic": traffic}
        report["conversion_rows"] = conversion_rows(conversions)
        report["conversions_s"] = time.monotonic() - started
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if reason := missing():
        print(f"sglang_figures: {reason}")
        return 1
    fleet = [
        server("p0", "prefill", extra=NO_RADIX),
        server("p1", "prefill", patched=True, extra=NO_RADIX),
        server("d0", "decode", extra=NO_RADIX),
        server("d1", "decode", patched=True, extra=NO_RADIX),
    ]
    report: dict[str, Any] = {
        "sglang": "0.5.23",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "loadavg_start": os.getloadavg()[0],
        "clients": args.clients,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    started = time.monotonic()
    print("-- starting 4 real SGLang servers on the CPU (1.5-3 minutes on 2 cores)", flush=True)
    try:
        with running(fleet):
            report["startup_s"] = time.monotonic() - started
            print(f"   ready in {report['startup_s']:.0f} s", flush=True)
            report |= measure(fleet, args)
    except pytest.skip.Exception as exc:  # the helpers' require(): no venv, too little memory
        print(f"sglang_figures: {exc.msg}")
        return 1
    except (RuntimeError, RequestFailed) as exc:  # a server that did not start, a failed leg
        print(f"sglang_figures: {exc}")
        return 1
    report["loadavg_end"] = os.getloadavg()[0]
    report["run_s"] = time.monotonic() - started
    text = markdown(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"sglang-figures-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    print(f"-- written {stem}.md and .json in {report['run_s']:.0f} s")
    ok = report["traffic"]["failed"] == 0 and all(
        c["status"] == "succeeded" for c in report["conversions"]
    )
    return 0 if ok and report["different_answers"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
