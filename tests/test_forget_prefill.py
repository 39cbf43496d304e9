"""When a worker becomes a prefill again the router makes every decode forget what it cached
about that prefill (``POST /pd_forget_prefill``): SGLang's decodes keep a prefill's rank
endpoints across its round trip through decode and hang on them (docs/sglang-bugs.md, bug b).
Reference workers answer the route as server_patch does; the real-SGLang proof is in
tests/test_sglang_bugs.py. Real workers and a real router on loopback."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from pd_router.control.workers import Role
from tests.conversion_helpers import convert
from tests.router_helpers import (
    fault,
    generate_body,
    running_router,
    wait_until,
    worker_metric,
)

FORGOT = "decode {decode} forgot the endpoints of prefill {prefill}"


def forgot(caplog: pytest.LogCaptureFixture, decode: str, prefill: str) -> bool:
    return FORGOT.format(decode=decode, prefill=prefill) in caplog.text


async def test_conversion_to_prefill_makes_every_decode_forget_the_worker(
    cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pd_router.control.worker_control")
    cluster = cluster_factory(prefill=1, decode=3)
    converted, *others = cluster.decode_urls
    async with running_router(cluster) as router, router.client() as http:
        reply = await convert(http, server_url=converted, new_role="prefill")
        assert reply.status_code == 200, reply.text
    assert all(forgot(caplog, decode, converted) for decode in others)


async def test_conversion_to_decode_asks_no_decode_to_forget(
    cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pd_router.control.worker_control")
    cluster = cluster_factory(prefill=2, decode=1)
    converted = cluster.prefill_urls[0]
    async with running_router(cluster) as router, router.client() as http:
        reply = await convert(http, server_url=converted, new_role="decode")
        assert reply.status_code == 200, reply.text
    assert "forgot the endpoints" not in caplog.text


async def test_a_worker_found_turned_prefill_makes_the_decodes_forget_it(
    cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pd_router.control.worker_control")
    cluster = cluster_factory(prefill=1, decode=2)
    switched, other = cluster.decode_urls
    async with running_router(cluster) as router:
        worker = router.state.registry.get(switched)
        async with httpx.AsyncClient(timeout=10.0) as operator:
            reply = await operator.post(switched + "/pd_role_switch", json={"new_role": "prefill"})
        assert reply.json()["success"]
        await wait_until(lambda: worker.role is Role.PREFILL, 5.0, "router moved it")
        await wait_until(lambda: forgot(caplog, other, switched), 5.0, "decode forgot it")


async def test_a_pair_that_misses_its_rendezvous_makes_its_decode_forget_the_prefill(
    cluster_factory, caplog: pytest.LogCaptureFixture
) -> None:
    """The prefill's round trip was not seen by this router (another router's switch, or one
    faster than a probe): the first request through the pair waits out the rendezvous, the
    decode is told to forget, and the pair meets again after its cool-down."""
    caplog.set_level(logging.INFO, logger="pd_router.control.worker_control")
    cluster = cluster_factory(prefill=1, decode=2, speed=1.0)
    prefill, stale = cluster.prefill_urls[0], cluster.decode_urls[0]
    await fault(stale, stale_bootstrap=f"127.0.0.1:{cluster.bootstrap_port(prefill)}")
    pairs = {"rendezvous_timeout_secs": 1.5, "rendezvous_cooldown_secs": 0.5}
    router_config = {"legs": pairs, "decode_policy": "round_robin"}
    async with running_router(cluster, **router_config) as router, router.client() as http:
        first = await http.post("/generate", json=generate_body("stuck", 4))
        assert first.status_code == 200, first.text
        await wait_until(lambda: forgot(caplog, stale, prefill), 5.0, "decode forgot it")
        served = await worker_metric(stale, "num_requests_total")
        elapsed = []
        for n in range(6):
            started = time.monotonic()
            reply = await http.post("/generate", json=generate_body(f"met {n}", 4))
            assert reply.status_code == 200, reply.text
            elapsed.append(time.monotonic() - started)
            await asyncio.sleep(0.2)  # past the cool-down before the last ones
    assert max(elapsed) < 1.5, elapsed
    assert await worker_metric(stale, "num_requests_total") > served


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"bootstrap_host": "127.0.0.1", "bootstrap_port": 0}, "bootstrap_port"),
        ({"bootstrap_host": "127.0.0.1", "bootstrap_port": "8998"}, "bootstrap_port"),
        ({"bootstrap_port": 8998}, "bootstrap_host"),
        ({"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "rank": 0}, "rank"),
    ],
)
async def test_forget_prefill_refuses_a_body_naming_no_bootstrap_server(
    cluster_factory, body: dict, field: str
) -> None:
    decode = cluster_factory(prefill=1, decode=1).decode_urls[0]
    async with httpx.AsyncClient(timeout=10.0) as http:
        reply = await http.post(decode + "/pd_forget_prefill", json=body)
    assert reply.status_code == 400
    assert reply.json()["field"] == field
