"""The router's memory under large request bodies, read from ``/proc`` of a router process in
front of real aiohttp workers that read each body and reject it with 400 (a prompt too long for
them): the memory of a rejected body comes back at once, and the bodies in flight together stay
within the configured budget."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson
import pytest
from aiohttp import web

from tests.router_helpers import FakeWorker, serve_app, wait_until
from tests.router_process import router_process

MB = 1_000_000
# Above glibc's largest mmap threshold (32 MiB): every copy of a body is a mapping of its own,
# returned to the system when freed, so resident memory shows what the router still holds.
BODY_MB = 40
JSON = {"Content-Type": "application/json"}


def rejecting_worker(role: str, hold_secs: float) -> web.Application:
    """A worker that reads a whole request body, waits ``hold_secs``, and answers 400."""

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(hold_secs)
        return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)

    async def pd_role(request: web.Request) -> web.Response:
        return web.json_response({"role": role, "bootstrap_port": 8998})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application(client_max_size=2 * BODY_MB * MB)
    app.router.add_post("/generate", generate)
    app.router.add_get("/pd_role", pd_role)
    app.router.add_get("/health", ok)
    return app


async def rejecting_pair(hold_secs: float) -> AsyncIterator[tuple[FakeWorker, FakeWorker]]:
    prefill = await serve_app(rejecting_worker("prefill", hold_secs))
    decode = await serve_app(rejecting_worker("decode", hold_secs))
    try:
        yield prefill, decode
    finally:
        await asyncio.gather(prefill.stop(), decode.stop())


@pytest.fixture
async def quick_rejecters():
    async for pair in rejecting_pair(0.0):
        yield pair


@pytest.fixture
async def slow_rejecters():
    async for pair in rejecting_pair(1.0):
        yield pair


class StalledReader:
    """A decode worker that reads the first megabyte of a body, then nothing until
    ``resume`` is set; ``received`` is how much of each body it got in the end."""

    def __init__(self) -> None:
        self.resume = asyncio.Event()
        self.received: list[int] = []

    def app(self) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            got = len(await request.content.read(MB))
            await self.resume.wait()
            try:
                while chunk := await request.content.read(MB):
                    got += len(chunk)
            finally:
                self.received.append(got)
            return web.json_response({"error": {"message": "too late"}}, status=400)

        async def pd_role(request: web.Request) -> web.Response:
            return web.json_response({"role": "decode"})

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application(client_max_size=2 * BODY_MB * MB)
        app.router.add_post("/generate", generate)
        app.router.add_get("/pd_role", pd_role)
        app.router.add_get("/health", ok)
        return app


def big_body() -> bytes:
    return orjson.dumps({"text": "x" * (BODY_MB * MB), "sampling_params": {"max_new_tokens": 1}})


async def test_memory_of_large_bodies_the_workers_reject_comes_back(quick_rejecters):
    prefill, decode = quick_rejecters
    body = big_body()
    async with router_process(
        prefill=[(prefill.url, 8998)], decode=[decode.url], max_payload_size=2 * BODY_MB * MB
    ) as router:
        before = router.rss_mb()
        async with router.client(timeout=60.0) as http:
            statuses = [
                (await http.post("/generate", content=body, headers=JSON)).status_code
                for _ in range(5)
            ]
        assert statuses == [400] * 5
        await wait_until(
            lambda: router.rss_mb() - before < BODY_MB, 5.0, "resident memory back to start"
        )


async def test_a_leg_given_up_while_its_body_is_still_sent_drops_the_body_at_once():
    """The prefill rejects the request while the decode has read only the start of its body:
    the router answers, and neither keeps the rest in memory nor delivers it later."""
    stalled = StalledReader()
    prefill = await serve_app(rejecting_worker("prefill", 0.0))
    decode = await serve_app(stalled.app())
    body = big_body()
    try:
        async with router_process(
            prefill=[(prefill.url, 8998)], decode=[decode.url], max_payload_size=2 * BODY_MB * MB
        ) as router:
            before = router.rss_mb()
            async with router.client(timeout=60.0) as http:
                answer = await http.post("/generate", content=body, headers=JSON)
            assert answer.status_code == 400
            await wait_until(
                lambda: router.rss_mb() - before < BODY_MB, 5.0, "resident memory back to start"
            )
            stalled.resume.set()
            await wait_until(lambda: stalled.received, 5.0, "the decode worker read on")
            assert stalled.received[0] < len(body)
    finally:
        stalled.resume.set()
        await asyncio.gather(prefill.stop(), decode.stop())


async def test_bodies_beyond_the_in_flight_budget_get_503_and_memory_stays_bounded(
    slow_rejecters,
):
    prefill, decode = slow_rejecters
    body = big_body()
    async with router_process(
        prefill=[(prefill.url, 8998)],
        decode=[decode.url],
        max_payload_size=2 * BODY_MB * MB,
        max_inflight_body_bytes=int(2.5 * BODY_MB * MB),
    ) as router:
        before = router.rss_mb()
        async with router.client(timeout=60.0, limits=httpx.Limits(max_connections=16)) as http:
            answers = await asyncio.gather(
                *(http.post("/generate", content=body, headers=JSON) for _ in range(6))
            )
        peak = router.peak_rss_mb()
    statuses = sorted(answer.status_code for answer in answers)
    assert set(statuses) == {400, 503}
    assert statuses.count(400) <= 4
    for answer in answers:
        if answer.status_code == 503:
            assert answer.headers["Retry-After"] == "1"
            assert answer.json()["error"]["type"] == "overloaded"
    assert peak - before < 9 * BODY_MB
