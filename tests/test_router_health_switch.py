"""``[health] enabled = false`` (the peers' ``--disable-health-check``): no probe reaches any
worker, every worker counts as healthy, and requests are still routed, through a real router,
a real counting server and reference workers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from tests.router_helpers import assert_paired, generate_body, running_router, wait_until

OFF = {"health": {"enabled": False}}


@contextlib.asynccontextmanager
async def counting_worker() -> AsyncIterator[tuple[str, list[str]]]:
    """A server that answers 200 to every GET and records the paths asked for."""
    paths: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        paths.append(request.path)
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", paths
    finally:
        await runner.cleanup()


async def test_with_health_checks_on_a_worker_is_probed(free_port):
    unreachable = f"http://127.0.0.1:{free_port()}"
    async with (
        counting_worker() as (url, paths),
        running_router(prefill=[(unreachable, 8998)], decode=[url]),
    ):
        await wait_until(lambda: "/health" in paths, 5.0, what="a probe")


async def test_with_health_checks_off_no_worker_is_probed(free_port):
    async with counting_worker() as (url, paths):
        unreachable = f"http://127.0.0.1:{free_port()}"
        async with running_router(prefill=[(unreachable, 8998)], decode=[url], **OFF) as router:
            await asyncio.sleep(0.5)
            assert paths == []
            assert all(worker.healthy for worker in router.state.registry)
            async with router.client() as http:
                assert (await http.get("/readiness")).status_code == 200


async def test_with_health_checks_off_an_added_worker_is_healthy_without_a_probe():
    async with (
        counting_worker() as (url, paths),
        running_router(prefill=[], decode=[], **OFF) as router,
        router.client() as http,
    ):
        added = await http.post("/workers", json={"url": url, "role": "decode"})
        assert added.status_code == 201
        assert added.json()["healthy"] is True
        assert paths == []


async def test_with_health_checks_off_requests_are_routed(pd_cluster):
    async with running_router(pd_cluster, **OFF) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("hello", 4))
        assert response.status_code == 200
        assert assert_paired(response.json(), "hello", 4) == pd_cluster.prefill_urls[0]
