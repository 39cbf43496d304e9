"""Conversions that do not go to plan, through a real router and reference worker processes:
abort and timeout during the drain, safe and unsafe switch failures, a worker that lies about its
new role, a worker killed during the drain. Each ends in a defined place: back in the old pool,
or FAILED and out of every pool until an operator re-adds it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web

from tests.conversion_helpers import (
    conversion_status,
    convert,
    live_roles,
    pools,
    sample,
    start_long_request_on_a_decode,
    wait_for_busy,
    worker_entry,
    worker_role,
)
from tests.router_helpers import fault, generate_body, running_router, wait_until

SPEED = 0.05


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=2, speed=SPEED)


@pytest.fixture
async def router(cluster):
    prefill, decode = await live_roles(cluster)
    async with running_router(cluster, prefill=prefill, decode=decode) as r:
        yield r


@pytest.fixture
async def http(router):
    async with router.client() as client:
        yield client


async def test_abort_during_drain_returns_the_worker_to_its_old_pool(http):
    request, busy = await start_long_request_on_a_decode(http)
    started = await convert(http, server_url=busy, wait=False)
    conversion_id = started.json()["id"]
    draining = (await http.get(f"/conversions/{conversion_id}")).json()
    assert draining["status"] == "draining"
    assert draining["progress"]["router_inflight"] == 1
    assert busy not in (await pools(http))["decode"]
    aborted = await http.delete(f"/conversions/{conversion_id}")
    assert aborted.status_code == 200
    assert aborted.json()["status"] == "aborted"
    entry = await worker_entry(http, busy)
    assert (entry["role"], entry["state"], entry["epoch"]) == ("decode", "active", 0)
    assert (await worker_role(busy))["draining"] is False
    assert (await request).status_code == 200


async def test_pool_size_worker_state_and_outcome_follow_a_drain_and_its_abort(http):
    request, busy = await start_long_request_on_a_decode(http)
    decodes = await sample(http, "pd_router_pool_size", role="decode")
    started = await convert(http, server_url=busy, wait=False)
    assert await sample(http, "pd_router_worker_state", worker=busy, state="draining") == 1.0
    assert await sample(http, "pd_router_worker_state", worker=busy, state="active") == 0.0
    assert await sample(http, "pd_router_pool_size", role="decode") == decodes - 1
    assert (await http.delete(f"/conversions/{started.json()['id']}")).status_code == 200
    assert await sample(http, "pd_router_worker_state", worker=busy, state="draining") == 0.0
    assert await sample(http, "pd_router_worker_state", worker=busy, state="active") == 1.0
    assert await sample(http, "pd_router_pool_size", role="decode") == decodes
    outcome = {"from_role": "decode", "to_role": "prefill", "outcome": "aborted"}
    assert await sample(http, "pd_router_conversions_total", **outcome) == 1.0
    assert (await request).status_code == 200


async def test_an_aborted_drain_is_timed_in_the_drain_phase(http):
    request, busy = await start_long_request_on_a_decode(http)
    started = await convert(http, server_url=busy, wait=False)
    assert (await http.delete(f"/conversions/{started.json()['id']}")).status_code == 200
    assert await sample(http, "pd_router_conversion_phase_seconds_count", phase="drain") == 1.0
    assert await sample(http, "pd_router_conversion_phase_seconds_count", phase="switch") == 0.0
    assert await sample(http, "pd_router_conversion_phase_seconds_count", phase="total") == 1.0
    assert (await request).status_code == 200


async def test_abort_after_the_conversion_ended_is_409_not_abortable(http):
    request, busy = await start_long_request_on_a_decode(http)
    record = (await convert(http, server_url=busy, drain_timeout_secs=0.05)).json()
    assert record["status"] == "drain_timeout"
    refused = await http.delete(f"/conversions/{record['id']}")
    assert refused.status_code == 409
    assert refused.json()["error"]["reason"] == "not_abortable"
    assert (await request).status_code == 200


async def test_second_conversion_beyond_the_global_cap_is_refused(http):
    request, busy = await start_long_request_on_a_decode(http)
    started = await convert(http, server_url=busy, wait=False)
    assert started.status_code == 202
    other = (await pools(http))["prefill"][0]
    refused = await convert(http, server_url=other)
    assert refused.status_code == 409
    assert refused.json()["error"]["reason"] == "too_many_conversions"
    assert (await worker_entry(http, other))["state"] == "active"
    assert (await http.delete(f"/conversions/{started.json()['id']}")).status_code == 200
    assert (await request).status_code == 200


async def test_drain_timeout_returns_the_worker_to_its_old_pool(http):
    request, busy = await start_long_request_on_a_decode(http)
    response = await convert(http, server_url=busy, drain_timeout_secs=0.2)
    assert response.status_code == 400
    record = response.json()
    assert record["status"] == "drain_timeout"
    assert "in flight" in record["message"]
    entry = await worker_entry(http, busy)
    assert (entry["role"], entry["state"]) == ("decode", "active")
    assert (await worker_role(busy))["draining"] is False
    assert (await request).status_code == 200


async def test_safe_switch_failure_returns_the_worker_to_its_old_pool(http):
    prefill = (await pools(http))["prefill"][0]  # never a decode: it has no decode graphs yet
    response = await convert(
        http, server_url=prefill, new_role="decode", decode_cuda_graph_memory_gb=1000.0
    )
    assert response.status_code == 400
    record = response.json()
    assert record["status"] == "restored"
    assert record["worker_replies"][-1]["body"]["safe_to_restore"] is True
    assert "headroom" in record["message"]
    entry = await worker_entry(http, prefill)
    assert (entry["role"], entry["state"], entry["epoch"]) == ("prefill", "active", 0)
    assert (await worker_role(prefill))["draining"] is False
    reply = await http.post("/generate", json={"text": "still serving", "sampling_params": {}})
    assert reply.status_code == 200


async def test_worker_lying_about_its_new_role_is_failed_and_can_be_re_added(http, cluster):
    prefill = (await pools(http))["prefill"][0]
    await fault(prefill, lie_next_switch=True)
    response = await convert(http, server_url=prefill)
    assert response.status_code == 400
    record = response.json()
    assert record["status"] == "failed"
    assert "reports prefill" in record["message"]
    assert record["worker_replies"][0]["body"]["success"] is True
    entry = await worker_entry(http, prefill)
    assert entry["state"] == "failed"
    assert prefill not in (await pools(http))["prefill"] + (await pools(http))["decode"]
    re_added = await http.post("/workers", json={"url": prefill, "role": "prefill"})
    assert re_added.status_code == 201
    assert re_added.json()["state"] == "active"


async def test_unsafe_switch_failure_is_failed_out_of_every_pool(http, cluster):
    spare = await asyncio.to_thread(cluster.add, "prefill")
    added = await http.post("/workers", json={"url": spare.url, "role": "prefill"})
    assert added.status_code == 201
    await fault(spare.url, fail_next_switch=True)
    response = await convert(http, server_url=spare.url)
    assert response.status_code == 400
    record = response.json()
    assert record["status"] == "failed"
    assert record["worker_replies"][-1]["body"]["safe_to_restore"] is False
    entry = await worker_entry(http, spare.url)
    assert entry["state"] == "failed"
    current = await pools(http)
    assert spare.url not in current["prefill"] + current["decode"]
    metrics = (await http.get("/metrics")).text
    assert f'pd_router_worker_state{{state="failed",worker="{spare.url}"}} 1.0' in metrics
    assert 'outcome="failed",to_role="decode"} 1.0' in metrics
    refused = await convert(http, server_url=spare.url)
    assert refused.status_code == 409


@contextlib.asynccontextmanager
async def router_over_a_busy_spare_decode(cluster, **overrides):
    """A router over one prefill and a fresh decode busy with an endless generation; yields
    (client, the decode's process, the request's task) for a test that kills the decode."""
    spare = await asyncio.to_thread(cluster.add, "decode")
    prefill, _ = await live_roles(cluster)
    async with (
        running_router(
            prefill=prefill[:1], decode=[spare.url], conversion={"min_decode": 0}, **overrides
        ) as router,
        router.client() as http,
    ):
        endless = {"text": "killed midway", "sampling_params": {"max_new_tokens": 50000}}
        request = asyncio.create_task(http.post("/generate", json=endless))
        await wait_for_busy([spare.url])
        yield http, spare, request


async def test_worker_killed_during_the_drain_goes_back_unhealthy(cluster):
    async with router_over_a_busy_spare_decode(cluster) as (http, spare, request):
        started = await convert(http, server_url=spare.url, wait=False)
        conversion_id = started.json()["id"]
        await asyncio.to_thread(cluster.kill, spare.url)

        async def ended() -> bool:
            return await conversion_status(http, conversion_id) != "draining"

        await wait_until(ended, within=10.0, what="conversion ends after the worker died")
        record = (await http.get(f"/conversions/{conversion_id}")).json()
        assert record["status"] == "restored", (record["message"], record["worker_replies"])
        assert "unreachable" in record["message"]
        entry = await worker_entry(http, spare.url)
        assert (entry["role"], entry["state"], entry["healthy"]) == ("decode", "active", False)
        await request


async def test_with_probes_off_a_worker_killed_during_the_drain_serves_again_once_back(cluster):
    """No probe would ever see it recover: it is not marked unhealthy, its requests decide."""
    async with router_over_a_busy_spare_decode(cluster, health={"enabled": False}) as (
        http, spare, request,
    ):  # fmt: skip
        started = await convert(http, server_url=spare.url, wait=False)
        conversion_id = started.json()["id"]
        await asyncio.to_thread(cluster.kill, spare.url)

        async def ended() -> bool:
            return await conversion_status(http, conversion_id) != "draining"

        await wait_until(ended, within=10.0, what="conversion ends after the worker died")
        await request
        entry = await worker_entry(http, spare.url)
        assert (entry["state"], entry["healthy"]) == ("active", True)
        assert "unreachable" in entry["last_error"]
        await asyncio.to_thread(cluster.restart, spare.url)
        reply = await http.post("/generate", json=generate_body("back", 2))
        assert reply.status_code == 200, reply.text


async def test_mini_lb_switch_of_a_worker_that_dies_is_400_safe_to_restore(cluster):
    async with router_over_a_busy_spare_decode(cluster) as (http, spare, request):
        body = {"worker_url": spare.url, "new_role": "prefill"}
        switch = asyncio.create_task(http.post("/pd_role_switch", json=body))

        async def draining() -> bool:
            return bool((await http.get("/conversions")).json()["active"])

        await wait_until(draining, within=10.0, what="the mini_lb call started a conversion")
        await asyncio.to_thread(cluster.kill, spare.url)
        response = await switch
        assert response.status_code == 400, response.text
        reply = response.json()
        assert (reply["success"], reply["safe_to_restore"]) == (False, True)
        assert (reply["old_role"], reply["new_role"]) == ("decode", "prefill")
        await request


@contextlib.asynccontextmanager
async def decode_peer_with_a_held_server_info(release: asyncio.Event):
    """A healthy decode whose /server_info, once ``hold`` is set, answers only at ``release``:
    the conversion to decode waits there for the peer's graph parameters after its drain."""
    hold = asyncio.Event()

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def server_info(_request: web.Request) -> web.Response:
        if hold.is_set():
            await release.wait()
        state = {"disaggregation_mode": "decode", "decode_cuda_graph_bs": [1, 2]}
        return web.json_response(
            {"internal_states": [{**state, "decode_cuda_graph_memory_gb": 0.1}]}
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/server_info", server_info)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", hold
    finally:
        release.set()
        await runner.cleanup()


async def test_abort_while_waiting_for_the_decode_peer_after_the_drain_is_an_abort(cluster):
    prefill, _ = await live_roles(cluster)
    release = asyncio.Event()
    async with (
        decode_peer_with_a_held_server_info(release) as (peer, hold),
        running_router(prefill=prefill[:1], decode=[peer], conversion={"min_prefill": 0}) as router,
        router.client() as http,
    ):
        await wait_until(
            lambda: worker_healthy(http, peer), within=10.0, what="the decode peer is healthy"
        )
        hold.set()
        started = await convert(http, server_url=prefill[0], new_role="decode", wait=False)
        conversion_id = started.json()["id"]

        async def drained() -> bool:
            record = (await http.get(f"/conversions/{conversion_id}")).json()
            return record["phases"][0]["ended_at"] is not None

        await wait_until(drained, within=10.0, what="the drain ended, the peer still holds")
        aborted = await http.delete(f"/conversions/{conversion_id}")
        release.set()
        assert aborted.status_code == 200, aborted.text
        assert aborted.json()["status"] == "aborted"
        entry = await worker_entry(http, prefill[0])
        assert (entry["role"], entry["state"], entry["epoch"]) == ("prefill", "active", 0)


async def worker_healthy(http, url: str) -> bool:
    return (await worker_entry(http, url))["healthy"] is True
