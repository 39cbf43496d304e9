"""Router-side test helpers: a real router (aiohttp server on a free loopback port) in front of
reference workers, and bounded polling.

    async with running_router(cluster, policy="round_robin") as router:
        async with router.client() as http:
            await http.post("/generate", json={...})
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import orjson
from aiohttp import web

from pd_router.config import load_config, merge
from pd_router.runtime.router import build_app
from pd_router.runtime.serve import RunningServer, start_server
from pd_worker.cluster import WorkerCluster
from pd_worker.tokens import expected_text

FAST_HEALTH = {"interval_secs": 0.05, "timeout_secs": 1.0, "failure_threshold": 2,
               "success_threshold": 2}  # fmt: skip


class RouterUnderTest:
    """A started router and how to talk to it."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.url = server.url
        self.state = server.router
        self.dataplane = server.dataplane

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 30.0)
        return httpx.AsyncClient(base_url=self.url, **kwargs)


def router_overrides(
    prefill: Sequence[str | tuple[str, int]], decode: Sequence[str], **overrides: Any
) -> dict[str, Any]:
    """A config dict for these workers with fast health probes, ``overrides`` on top."""
    specs = []
    for entry in prefill:
        url, port = entry if isinstance(entry, tuple) else (entry, None)
        specs.append({"url": url} if port is None else {"url": url, "bootstrap_port": port})
    base = {
        "host": "127.0.0.1",
        "port": 0,
        "prefill": specs,
        "decode": [{"url": u} for u in decode],
        "health": dict(FAST_HEALTH),
        "retry": {"backoff_base_secs": 0.0, "backoff_max_secs": 0.0},
        "log_format": "text",
    }
    return merge(base, overrides)


@contextlib.asynccontextmanager
async def running_router(
    cluster: WorkerCluster | None = None,
    *,
    prefill: Sequence[str | tuple[str, int]] | None = None,
    decode: Sequence[str] | None = None,
    **overrides: Any,
) -> AsyncIterator[RouterUnderTest]:
    """A router over ``cluster``'s workers (or explicit urls), stopped on exit."""
    prefill = list(prefill if prefill is not None else cluster.prefill_urls)
    decode = list(decode if decode is not None else cluster.decode_urls)
    config = load_config(None, router_overrides(prefill, decode, **overrides))
    server = await start_server(build_app(config), "127.0.0.1", 0)
    try:
        yield RouterUnderTest(server)
    finally:
        await server.stop()


@dataclasses.dataclass
class FakeWorker:
    """A stand-in worker: an aiohttp application on a free loopback port."""

    runner: web.AppRunner
    url: str

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_app(app: web.Application) -> FakeWorker:
    """Serve ``app`` on a free loopback port (a worker with a behaviour of the test's own)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return FakeWorker(runner, f"http://{host}:{port}")


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]], within: float = 10.0, what: str = ""
) -> None:
    """Poll ``condition`` every 20 ms until it holds; AssertionError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s: {what}")
        await asyncio.sleep(0.02)


def generate_body(prompt: str, tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": tokens}, **extra}


def assert_paired(item: dict[str, Any], prompt: str | list[int], tokens: int) -> str:
    """The decode's output proves it pulled this prompt's KV; returns the prefill it came from."""
    assert item["text"] == expected_text(prompt, tokens)
    return item["meta_info"]["kv_source"]


async def worker_metric(url: str, name: str) -> float:
    """One ``sglang:`` metric of a worker (its /metrics)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        text = (await http.get(url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith(f"sglang:{name}{{") or line.startswith(f"sglang:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def worker_idle(url: str) -> bool:
    """Whether a reference worker is fully idle (nothing running, queued or in transfer)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        return bool((await http.get(url + "/pd_role")).json()["idle"])


async def settled(router: RouterUnderTest, *urls: str, within: float = 5.0) -> None:
    """Until every reference worker in ``urls`` is idle and the router has nothing in flight
    (a cancelled request's legs all ended and were counted)."""
    for url in urls:
        await wait_until(lambda url=url: worker_idle(url), within, f"{url} idle")
    await wait_until(
        lambda: all(w.inflight == 0 for w in router.state.registry), within, "router in-flight 0"
    )


async def fault(url: str, **body: Any) -> None:
    """Inject a fault into a reference worker (``POST /fault``)."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        response = await http.post(url + "/fault", json=body)
    response.raise_for_status()


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body (``[DONE]`` kept as the string)."""
    events = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data:"):
            data = block[5:].strip()
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events
