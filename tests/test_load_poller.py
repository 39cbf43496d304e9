"""The load-report poller against real answers: a reference worker's ``/v1/loads`` becomes its
report in the registry; a worker that answers too late, or not in SGLang's shape, has none,
and a round does not wait past the call timeout for it; only the pools it was asked for are
read."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from pd_router.control.load_poller import CALL_TIMEOUT_SECS, LoadPoller
from pd_router.control.load_report import LoadReport
from pd_router.control.workers import WorkerRegistry
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from tests.router_helpers import serve_app


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


async def silent_worker(delay: float, body: bytes = b"{}") -> web.Application:
    """A worker whose ``/v1/loads`` answers ``body`` after ``delay`` seconds."""

    async def loads(request: web.Request) -> web.Response:
        await asyncio.sleep(delay)
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/loads", loads)
    return app


async def test_a_round_reads_each_worker_s_own_report(cluster):
    registry = WorkerRegistry(RouterMetrics())
    prefill = registry.add(cluster.prefill_urls[0], Role.PREFILL)
    async with aiohttp.ClientSession() as session:
        poller = LoadPoller(registry, session, {Role.PREFILL})
        assert await poller.poll_once()
    report = prefill.load_report
    assert isinstance(report, LoadReport)
    assert (report.running, report.waiting, report.ranks) == (0, 0, 1)


async def test_a_worker_that_does_not_answer_in_time_has_no_report(cluster):
    late = await serve_app(await silent_worker(CALL_TIMEOUT_SECS * 4))
    registry = WorkerRegistry(RouterMetrics())
    prefill = registry.add(cluster.prefill_urls[0], Role.PREFILL)
    slow = registry.add(late.url, Role.PREFILL)
    try:
        async with aiohttp.ClientSession() as session:
            poller = LoadPoller(registry, session, {Role.PREFILL})
            started = time.monotonic()
            await poller.poll_once()
            took = time.monotonic() - started
    finally:
        await late.stop()
    assert took < CALL_TIMEOUT_SECS * 2
    assert slow.load_report is None
    assert prefill.load_report is not None


async def test_an_answer_not_shaped_as_sglang_s_is_no_report():
    odd = await serve_app(await silent_worker(0.0, b'{"loads": "busy"}'))
    registry = WorkerRegistry(RouterMetrics())
    worker = registry.add(odd.url, Role.DECODE)
    try:
        async with aiohttp.ClientSession() as session:
            await LoadPoller(registry, session, {Role.DECODE}).poll_once()
    finally:
        await odd.stop()
    assert worker.load_report is None


async def test_only_the_pools_asked_for_are_read_and_a_worker_leaving_them_loses_its_report(
    cluster,
):
    registry = WorkerRegistry(RouterMetrics())
    prefill = registry.add(cluster.prefill_urls[0], Role.PREFILL)
    decode = registry.add(cluster.decode_urls[0], Role.DECODE)
    async with aiohttp.ClientSession() as session:
        poller = LoadPoller(registry, session, {Role.DECODE})
        await poller.poll_once()
        assert prefill.load_report is None
        assert decode.load_report is not None
        registry.set_health(decode, False)
        assert await poller.poll_once()
    assert decode.load_report is None


async def test_steady_reports_do_not_count_as_moving(cluster):
    registry = WorkerRegistry(RouterMetrics())
    registry.add(cluster.decode_urls[0], Role.DECODE)
    async with aiohttp.ClientSession() as session:
        poller = LoadPoller(registry, session, {Role.DECODE})
        assert await poller.poll_once()
        assert not await poller.poll_once()
