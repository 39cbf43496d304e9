"""Fault injection (POST /fault) and admin-key guarding on the reference worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pd_worker.testing import new_room, with_bootstrap

TIMEOUT = 10.0
SHORT = 0.3
ADMIN = {"Authorization": "Bearer sesame"}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(
        prefill=1, decode=1, bootstrap_timeout_secs=SHORT, room_timeout_secs=SHORT
    )


@pytest.fixture
async def clear_faults(cluster):
    yield
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        for url in cluster.urls:
            await c.post(url + "/fault", json={"clear": True})


async def test_fail_next_fails_that_many_generation_requests(cluster, client, clear_faults):
    url = cluster.decode_urls[0]
    reply = await client.post(url + "/fault", json={"fail_next": 2, "fail_status": 502})
    assert reply.json()["faults"]["fail_next"] == 2
    statuses = [
        (await client.post(url + "/generate", json={"text": "f"})).status_code for _ in range(3)
    ]
    assert statuses == [502, 502, 200]


async def test_delay_holds_each_generation_request(cluster, client, clear_faults):
    url = cluster.decode_urls[0]
    await client.post(url + "/fault", json={"delay_secs": SHORT})
    started = time.monotonic()
    response = await client.post(url + "/generate", json={"text": "slow"})
    assert response.status_code == 200
    assert time.monotonic() - started >= SHORT


async def test_hung_bootstrap_fails_the_decode_and_frees_the_prefill_room(
    cluster, client, clear_faults
):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    await client.post(prefill + "/fault", json={"hang_bootstrap": True})
    body = with_bootstrap({"text": "hang"}, cluster.bootstrap_port(prefill), new_room())
    p, d = await asyncio.gather(
        client.post(prefill + "/generate", json=body), client.post(decode + "/generate", json=body)
    )
    assert d.status_code == 500 and "timed out" in d.json()["message"]
    assert p.status_code == 500 and "Prefill bootstrap failed" in p.json()["message"]
    assert (await client.get(prefill + "/pd_role")).json()["idle"] is True


async def test_stale_bootstrap_hangs_the_pair_until_the_bootstrap_timeout(
    cluster, client, clear_faults
):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    port = cluster.bootstrap_port(prefill)
    await client.post(decode + "/fault", json={"stale_bootstrap": f"127.0.0.1:{port}"})
    body = with_bootstrap({"text": "stale"}, port, new_room())
    started = time.monotonic()
    p, d = await asyncio.gather(
        client.post(prefill + "/generate", json=body), client.post(decode + "/generate", json=body)
    )
    assert time.monotonic() - started >= SHORT
    assert d.status_code == 500 and "timed out" in d.json()["message"]
    assert p.status_code == 500 and "Prefill bootstrap failed" in p.json()["message"]


async def test_stale_bootstrap_spares_the_other_prefills(cluster, client, clear_faults):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    await client.post(decode + "/fault", json={"stale_bootstrap": "127.0.0.1:1"})
    body = with_bootstrap({"text": "fresh"}, cluster.bootstrap_port(prefill), new_room())
    p, d = await asyncio.gather(
        client.post(prefill + "/generate", json=body), client.post(decode + "/generate", json=body)
    )
    assert (p.status_code, d.status_code) == (200, 200)


async def test_unhealthy_fault_turns_health_503_until_cleared(cluster, client, clear_faults):
    url = cluster.prefill_urls[0]
    await client.post(url + "/fault", json={"unhealthy": True})
    assert (await client.get(url + "/health")).status_code == 503
    await client.post(url + "/fault", json={"clear": True})
    assert (await client.get(url + "/health")).status_code == 200


async def test_lie_next_switch_claims_success_but_keeps_the_role(cluster, client, clear_faults):
    url = cluster.decode_urls[0]
    await client.post(url + "/fault", json={"lie_next_switch": True})
    reply = await client.post(url + "/pd_role_switch", json={"new_role": "prefill"})
    assert reply.status_code == 200
    assert reply.json()["success"] is True and reply.json()["new_role"] == "prefill"
    info = (await client.get(url + "/server_info")).json()
    assert info["internal_states"][0]["disaggregation_mode"] == "decode"


async def test_native_only_hides_the_extension_routes(cluster, client, clear_faults):
    url = cluster.decode_urls[0]
    await client.post(url + "/fault", json={"native_only": True})
    assert (await client.get(url + "/pd_role")).status_code == 404
    assert (await client.post(url + "/pd_drain", json={"drain": True})).status_code == 404
    assert (await client.post(url + "/convert_pd_role", json={})).status_code == 404
    native = await client.post(url + "/pd_role_switch", json={"new_role": "decode"})
    assert native.status_code == 200 and native.json()["old_role"] == "decode"


async def test_unknown_fault_field_is_400(cluster, client):
    response = await client.post(cluster.decode_urls[0] + "/fault", json={"explode": True})
    assert response.status_code == 400
    assert "explode" in response.json()["error"]["message"]


async def test_refused_fault_body_sets_no_fault(cluster, client, clear_faults):
    url = cluster.decode_urls[0]
    refused = await client.post(url + "/fault", json={"fail_next": 2, "fail_status": 200})
    assert refused.status_code == 400
    assert (await client.post(url + "/fault", json={})).json()["faults"]["fail_next"] == 0
    assert (await client.post(url + "/generate", json={"text": "ok"})).status_code == 200


async def test_exit_fault_ends_the_process_with_that_code(cluster_factory, client):
    c = cluster_factory(prefill=0, decode=1)
    url = c.decode_urls[0]
    assert (await client.post(url + "/fault", json={"exit": 3})).status_code == 200
    process = c.worker(url).process
    assert await asyncio.to_thread(process.wait, TIMEOUT) == 3


async def test_fault_route_is_404_unless_enabled(cluster_factory, client):
    c = cluster_factory(prefill=0, decode=1, enable_faults=False)
    response = await client.post(c.decode_urls[0] + "/fault", json={"fail_next": 1})
    assert response.status_code == 404


async def test_admin_routes_need_the_admin_key_when_one_is_set(cluster_factory, client):
    c = cluster_factory(prefill=1, decode=0, admin_api_key="sesame")
    url = c.prefill_urls[0]
    for path, body in (("/fault", {"fail_next": 0}), ("/pd_role_switch", {"new_role": "prefill"})):
        assert (await client.post(url + path, json=body)).status_code == 401
        assert (await client.post(url + path, json=body, headers=ADMIN)).status_code == 200
    assert (await client.post(url + "/generate", json={"text": "open"})).status_code == 200
