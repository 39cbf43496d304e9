"""Conversion of workers that speak only SGLang's native control protocol (``/pd_role_switch``,
``/server_info``, ``/v1/loads``; the reference workers hide their extension routes with the
``native_only`` fault): the router drains on its own, fills the decode graph parameters from a
decode peer and reads the new role back from ``internal_states``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_worker.testing import pd_generate
from tests.conversion_helpers import (
    CheckedLoad,
    arrange,
    convert,
    live_roles,
    pools,
    wait_for_busy,
    worker_entry,
)
from tests.router_helpers import fault, running_router

SPEED = 0.05


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=2, speed=SPEED)


@pytest.fixture
async def router(cluster):
    prefill, decode = await live_roles(cluster)
    for url in cluster.urls:
        await fault(url, native_only=True)
    try:
        async with running_router(cluster, prefill=prefill, decode=decode) as r:
            yield r
    finally:
        for url in cluster.urls:
            await fault(url, native_only=False)


@pytest.fixture
async def http(router):
    """A client of the router, with the cluster back at two prefills and two decodes."""
    async with router.client() as client:
        await arrange(client, prefill=2)
        yield client


async def test_native_prefill_becomes_decode_under_load_with_peer_graph_parameters(http, router):
    prefill = (await pools(http))["prefill"][0]  # no decode graphs yet: needs the peer's figures
    async with CheckedLoad(router.url, concurrency=8) as load:
        await load.wait_for_requests(20)
        response = await convert(http, server_url=prefill)
        await load.wait_for_requests(load.result.ok + 20)
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["protocol"] == "native"
    assert record["worker_replies"][0]["call"] == "/pd_role_switch"
    assert load.result.failed == 0, load.result.errors[:3]
    entry = await worker_entry(http, prefill)
    assert (entry["role"], entry["state"], entry["has_extensions"]) == ("decode", "active", False)


async def test_native_decode_becomes_prefill_with_bootstrap_port_from_server_info(
    http, router, cluster
):
    decode = (await pools(http))["decode"][0]
    async with CheckedLoad(router.url, concurrency=8) as load:
        await load.wait_for_requests(20)
        response = await convert(http, server_url=decode, new_role="prefill")
        await load.wait_for_requests(load.result.ok + 20)
    assert response.status_code == 200, response.text
    assert load.result.failed == 0, load.result.errors[:3]
    entry = await worker_entry(http, decode)
    assert entry["role"] == "prefill"
    assert entry["bootstrap_port"] == cluster.bootstrap_port(decode)


async def test_restart_knob_for_a_native_worker_is_400_before_anything_changes(http):
    decode = (await pools(http))["decode"][0]
    history = (await http.get("/conversions")).json()["conversions"]
    response = await convert(http, server_url=decode, disable_radix_cache=True)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "disable_radix_cache"
    assert (await http.get("/conversions")).json()["conversions"] == history
    assert (await worker_entry(http, decode))["state"] == "active"


async def test_pr_9325_knobs_set_to_false_ask_for_nothing_and_convert(http):
    decode = (await pools(http))["decode"][0]
    response = await convert(
        http, server_url=decode, disable_cuda_graph=False, tp_size=None, check_idle=False
    )
    assert response.status_code == 200, response.text
    assert response.json()["to_role"] == "prefill"


async def test_native_worker_busy_with_another_routers_traffic_is_switched_once_idle(http, cluster):
    current = await pools(http)
    prefill, decode = current["prefill"][0], current["decode"][0]
    body = {"text": "from another router", "sampling_params": {"max_new_tokens": 1200}}
    async with httpx.AsyncClient(timeout=30.0) as direct:
        foreign = asyncio.create_task(
            pd_generate(direct, prefill, decode, cluster.bootstrap_port(prefill), body)
        )
        await wait_for_busy([decode])
        response = await convert(http, server_url=decode)
        prefill_reply, decode_reply = await foreign
    assert response.status_code == 200, response.text
    calls = response.json()["worker_replies"]
    switch_calls = [c for c in calls if c["call"] == "/pd_role_switch"]
    assert len(switch_calls) >= 2
    assert switch_calls[0]["status"] == 400
    assert switch_calls[0]["body"]["safe_to_restore"] is True
    assert switch_calls[-1]["body"]["success"] is True
    assert decode_reply.status_code == 200 and prefill_reply.status_code == 200


async def live_graph_batch_sizes(url: str) -> list[int] | None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        info = (await client.get(url + "/server_info")).json()
    return info["internal_states"][0]["decode_cuda_graph_bs"]


async def test_a_busy_refusal_is_retried_while_the_load_reads_idle(http):
    """SGLang's decode refuses a switch as "not idle" while the KV of an aborted transfer waits
    for its deferred release, with nothing running or waiting in its load: the router keeps
    calling until the worker agrees (well past the half second that ends other refusals)."""
    decode = (await pools(http))["decode"][0]
    await fault(decode, busy_switch_next=60)
    response = await convert(http, server_url=decode, new_role="prefill")
    assert response.status_code == 200, response.text
    refusals = [r for r in response.json()["worker_replies"] if r["status"] == 400]
    assert len(refusals) == 60
    assert response.json()["timings"]["switch_s"] > 1.0


async def test_graph_batch_sizes_come_from_the_peer_when_only_the_memory_is_given(cluster):
    """Two fresh prefills (no decode graphs captured yet): the first becomes a decode with the
    caller's batch sizes, the second is given only the memory and takes the sizes from it."""
    fresh = [await asyncio.to_thread(cluster.add, "prefill") for _ in range(2)]
    first, second = (worker.url for worker in fresh)
    custom = [1, 3, 5]
    try:
        for url in (first, second):
            await fault(url, native_only=True)
        async with (
            running_router(
                prefill=[first, second], decode=[], conversion={"min_prefill": 0, "min_decode": 0}
            ) as router,
            router.client() as http,
        ):
            response = await convert(
                http, server_url=first, decode_cuda_graph_bs=custom, decode_cuda_graph_memory_gb=0.5
            )
            assert response.status_code == 200, response.text
            response = await convert(http, server_url=second, decode_cuda_graph_memory_gb=0.25)
            assert response.status_code == 200, response.text
        assert await live_graph_batch_sizes(second) == custom
    finally:
        for url in (first, second):
            await asyncio.to_thread(cluster.kill, url)
