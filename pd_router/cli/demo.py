"""``pd-router demo`` (``make demo``): a 2P2D reference cluster behind the router, real traffic,
a summary.

Starts the reference workers (``pd_worker``) on free loopback ports, the router in this process,
then runs the steps in :data:`STEPS` in order; each step gets the :class:`Demo` context and prints
what it did. Every answer is checked: the decode's output is a function of the KV it pulled, so a
correct text proves the decode was paired with the right prefill and room. More steps (e.g. a
conversion) are added by appending an ``async def step(demo: Demo) -> None`` to :data:`STEPS`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from pd_protocol.listen import ListenError, check_can_listen
from pd_router.cli.logs import configure_logging
from pd_router.cli.usage import USAGE_ERROR, Parser
from pd_router.config import load_config
from pd_router.runtime.router import build_app
from pd_router.runtime.serve import RunningServer, start_server
from pd_worker.cluster import WorkerCluster
from pd_worker.tokens import chat_prompt, expected_text

DEMO_HOST = "127.0.0.1"
TOKENS = 8
OK = "ok (output matches its prefill's KV)"
MIX = "/generate single/stream/batch, /v1/completions, /v1/chat/completions stream"


@dataclass
class Demo:
    """What a step works with: the cluster, the running router, an HTTP client, the options."""

    args: argparse.Namespace
    cluster: WorkerCluster
    server: RunningServer
    http: httpx.AsyncClient
    latencies: list[float] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)

    def say(self, text: str = "") -> None:
        print(text, flush=True)


Step = Callable[[Demo], Awaitable[None]]


def request_for(i: int) -> tuple[str, dict[str, Any], Callable[[httpx.Response], bool]]:
    """The i-th request of the traffic mix and a check of its answer."""
    prompt = f"demo request {i}: route me through prefill and decode"
    kind = i % 5
    if kind == 0:
        body: dict[str, Any] = {"text": prompt, "sampling_params": {"max_new_tokens": TOKENS}}
        return "/generate", body, lambda r: r.json()["text"] == expected_text(prompt, TOKENS)
    if kind == 1:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": TOKENS}, "stream": True}
        return "/generate", body, lambda r: last_event(r)["text"] == expected_text(prompt, TOKENS)
    if kind == 2:
        prompts = [prompt, prompt + " (second item)"]
        body = {"text": prompts, "sampling_params": {"max_new_tokens": TOKENS}}
        return (
            "/generate",
            body,
            lambda r: [x["text"] for x in r.json()] == [expected_text(p, TOKENS) for p in prompts],
        )
    if kind == 3:
        body = {"prompt": prompt, "max_tokens": TOKENS}
        return (
            "/v1/completions",
            body,
            lambda r: r.json()["choices"][0]["text"] == expected_text(prompt, TOKENS),
        )
    messages: list[dict[str, object]] = [{"role": "user", "content": prompt}]
    body = {"messages": messages, "max_tokens": TOKENS, "stream": True}
    return (
        "/v1/chat/completions",
        body,
        lambda r: streamed_chat(r) == expected_text(chat_prompt(messages), TOKENS),
    )


def sse_payloads(response: httpx.Response) -> list[Any]:
    return [
        orjson.loads(line[5:])
        for line in response.text.splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]


def last_event(response: httpx.Response) -> dict[str, Any]:
    return sse_payloads(response)[-1]


def streamed_chat(response: httpx.Response) -> str:
    events = [e for e in sse_payloads(response) if e["choices"]]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)


async def send(demo: Demo, i: int) -> None:
    path, body, check = request_for(i)
    started = time.perf_counter()
    try:
        response = await demo.http.post(path, json=body)
        ok = response.status_code == 200 and check(response)
        outcome = OK if ok else f"wrong ({response.status_code})"
    except httpx.HTTPError as exc:
        outcome = f"error ({type(exc).__name__})"
    demo.latencies.append(time.perf_counter() - started)
    demo.outcomes[outcome] += 1


async def traffic(demo: Demo) -> None:
    """The traffic mix at fixed concurrency, then throughput, latency and outcomes."""
    total, concurrency = demo.args.requests, demo.args.concurrency
    demo.say(f"-- traffic: {total} requests, concurrency {concurrency} ({MIX})")
    queue = iter(range(total))
    started = time.perf_counter()

    async def client() -> None:
        for i in queue:
            await send(demo, i)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies = sorted(demo.latencies)
    demo.say(f"   {total / elapsed:.0f} requests/s over {elapsed:.2f} s, latency p50 "
             f"{statistics.median(latencies) * 1000:.1f} ms, p99 "
             f"{latencies[int(len(latencies) * 0.99) - 1] * 1000:.1f} ms")  # fmt: skip
    for outcome, count in demo.outcomes.most_common():
        demo.say(f"   {count:5d}  {outcome}")


async def worker_counts(demo: Demo) -> None:
    """How the router spread the load: generation requests seen by each worker."""
    demo.say("-- load per worker (requests each worker served, from its own /metrics)")
    for worker in demo.server.router.registry:
        metrics = (await demo.http.get(worker.url + "/metrics")).text
        served = next(
            (line.rsplit(" ", 1)[1] for line in metrics.splitlines()
             if line.startswith("sglang:num_requests_total")),
            "?",
        )  # fmt: skip
        demo.say(f"   {worker.role.value:8s} {worker.url:28s} {float(served):7.0f}")


async def pools(demo: Demo) -> None:
    demo.say("-- pools (GET /workers)")
    listing = (await demo.http.get("/workers")).json()
    for w in listing["workers"]:
        health = f"healthy={w['healthy']!s:5s} circuit={w['circuit']:9s}"
        demo.say(f"   {w['id']:4s} {w['role']:8s} {w['url']:28s} {w['state']:9s} {health} "
                 f"in-flight={w['inflight']}")  # fmt: skip


async def failure(demo: Demo) -> None:
    """Kill one decode mid-traffic: requests keep succeeding on the other pair."""
    victim = demo.cluster.decode_urls[-1]
    demo.say(f"-- failure: killing decode {victim}, then 40 more requests")
    demo.cluster.kill(victim)
    before = sum(demo.outcomes.values())
    await asyncio.gather(*(send(demo, demo.args.requests + i) for i in range(40)))
    sent = sum(demo.outcomes.values()) - before
    retries = demo.server.router.metrics.registry.get_sample_value("pd_router_retries_total")
    demo.say(f"   {sent} sent, {demo.outcomes[OK]} ok in total; retries so far: {retries:.0f}")


async def conversion(demo: Demo) -> None:
    """Move a prefill into the decode pool while traffic flows (POST /convert_pd_role)."""
    url = demo.cluster.prefill_urls[0]
    demo.say(f"-- conversion: {url} prefill -> decode while {demo.args.concurrency} clients send")
    await pools(demo)
    before, stop, ids = sum(demo.outcomes.values()), asyncio.Event(), iter(range(10**6))
    flowing = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            await send(demo, 2 * demo.args.requests + next(ids))
            if sum(demo.outcomes.values()) >= before + 2 * demo.args.concurrency:
                flowing.set()

    clients = [asyncio.create_task(client()) for _ in range(demo.args.concurrency)]
    await asyncio.wait_for(flowing.wait(), 30.0)
    record = (await demo.http.post("/convert_pd_role", json={"server_url": url})).json()
    stop.set()
    await asyncio.gather(*clients)
    t = record.get("timings", {})
    demo.say(f"   {record.get('status')}: {record.get('message')}; drain "
             f"{t.get('drain_s', 0) * 1000:.1f} ms, switch {t.get('switch_s', 0) * 1000:.1f} ms, "
             f"total {t.get('total_s', 0) * 1000:.1f} ms; {sum(demo.outcomes.values()) - before} "
             f"requests sent meanwhile, {demo.outcomes[OK]} ok in total")  # fmt: skip
    await pools(demo)


STEPS: list[Step] = [pools, traffic, worker_counts, conversion, failure, pools]
DESCRIPTION = (
    "A 2P2D reference cluster behind the router on loopback: real traffic, a conversion under "
    "load, a worker failure, and a summary of each step."
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = Parser(
        prog="pd-router demo",
        short_usage="pd-router demo [--prefill N] [--decode N] [--port PORT] [--keep-running]",
        description=DESCRIPTION,
    )
    p.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    p.add_argument("--requests", type=int, default=300,
                   help="requests of the traffic step (default 300)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=16,
                   help="clients sending them at once (default 16)")  # fmt: skip
    p.add_argument("--speed", type=float, default=0.2,
                   help="worker timing model speed (0: no simulated GPU time)")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    p.add_argument("--keep-running", action="store_true",
                   help="keep the cluster and router up after the steps")  # fmt: skip
    args = p.parse_args(list(argv))
    if args.prefill < 1 or args.decode < 2 or args.requests < 1 or args.concurrency < 1:
        p.error("need >= 1 prefill, >= 2 decodes, >= 1 request and concurrency >= 1")
    return args


async def run(args: argparse.Namespace) -> int:
    configure_logging("error", "text")
    print(f"starting {args.prefill}P + {args.decode}D reference workers ...", flush=True)
    async with WorkerCluster(prefill=args.prefill, decode=args.decode, speed=args.speed) as cluster:
        overrides = {
            "host": DEMO_HOST,
            "port": args.port,
            "prefill": [{"url": u} for u in cluster.prefill_urls],
            "decode": [{"url": u} for u in cluster.decode_urls],
            "log_level": "error",
            "health": {"interval_secs": 1.0},
        }
        server = await start_server(build_app(load_config(None, overrides)), DEMO_HOST, args.port)
        try:
            print(f"router listening on {server.url} (metrics: {server.url}/metrics)", flush=True)
            limits = httpx.Limits(max_connections=args.concurrency * 2)
            async with httpx.AsyncClient(base_url=server.url, timeout=60.0, limits=limits) as http:
                demo = Demo(args, cluster, server, http)
                for step in STEPS:
                    await step(demo)
                failed = sum(demo.outcomes.values()) - demo.outcomes[OK]
                demo.say(f"== summary: {sum(demo.outcomes.values())} requests, {failed} not ok")
                if args.keep_running:
                    demo.say(f"router still serving on {server.url}; Ctrl-C to stop")
                    await asyncio.Event().wait()
            return 0 if failed == 0 else 1
        finally:
            await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_can_listen(DEMO_HOST, args.port, "--port")
    except ListenError as exc:
        print(f"pd-router demo: {exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 0
