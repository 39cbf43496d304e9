"""When a worker becomes a prefill again the router makes every decode forget what it cached
about that prefill (``POST /pd_forget_prefill``): SGLang's decodes keep a prefill's rank
endpoints across its round trip through decode and hang on them (docs/sglang-bugs.md, bug b).
Reference workers answer the route as server_patch does; the real-SGLang proof is in
tests/test_sglang_bugs.py. Real workers and a real router on loopback."""

from __future__ import annotations

import logging

import httpx
import pytest

from pd_router.control.workers import Role
from tests.conversion_helpers import convert
from tests.router_helpers import running_router, wait_until

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
