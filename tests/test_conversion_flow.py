"""Role conversion through a real router in front of a 2P2D reference cluster: prefill to decode
and back while streaming and non-streaming clients keep sending, with every reply checked; the
refusals that must leave the pools untouched; the mini_lb-shaped call and the history API."""

from __future__ import annotations

import asyncio

import pytest

from tests.conversion_helpers import (
    CheckedLoad,
    arrange,
    convert,
    live_roles,
    pools,
    wait_for_busy,
    worker_entry,
    worker_role,
)
from tests.router_helpers import running_router

SPEED = 0.05


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=2, speed=SPEED)


@pytest.fixture
async def router(cluster):
    prefill, decode = await live_roles(cluster)
    async with running_router(
        cluster, prefill=prefill, decode=decode, conversion={"max_concurrent": 2}
    ) as r:
        yield r


@pytest.fixture
async def http(router):
    """A client of the router, with the cluster back at two prefills and two decodes."""
    async with router.client() as client:
        await arrange(client, prefill=2)
        yield client


async def test_prefill_becomes_decode_under_streaming_load_with_no_failed_request(http, router):
    prefill = (await pools(http))["prefill"][0]
    async with CheckedLoad(router.url, concurrency=8) as load:
        await load.wait_for_requests(20)
        response = await convert(http, server_url=prefill, new_role="decode")
        await load.wait_for_requests(load.result.ok + 20)
    assert response.status_code == 200, response.text
    record = response.json()
    assert record["status"] == "succeeded"
    assert record["from_role"] == "prefill" and record["to_role"] == "decode"
    assert [p["name"] for p in record["phases"]] == ["drain", "switch", "verify"]
    assert load.result.failed == 0, load.result.errors[:3]
    assert (await worker_role(prefill))["role"] == "decode"
    entry = await worker_entry(http, prefill)
    assert (entry["role"], entry["state"], entry["epoch"]) == ("decode", "active", 1)
    assert len((await pools(http))["decode"]) == 3


async def test_decode_becomes_prefill_under_streaming_load_with_no_failed_request(http, router):
    decode = (await pools(http))["decode"][0]
    async with CheckedLoad(router.url, concurrency=8) as load:
        await load.wait_for_requests(20)
        response = await convert(http, server_url=decode)
        await load.wait_for_requests(load.result.ok + 20)
    assert response.status_code == 200, response.text
    assert response.json()["to_role"] == "prefill"
    assert load.result.failed == 0, load.result.errors[:3]
    entry = await worker_entry(http, decode)
    assert (entry["role"], entry["state"]) == ("prefill", "active")
    assert entry["bootstrap_port"] == (await worker_role(decode))["bootstrap_port"]
    assert response.json()["bootstrap_port"] == entry["bootstrap_port"]


async def test_new_prefill_serves_requests_paired_with_its_own_bootstrap(http, cluster):
    decode = (await pools(http))["decode"][0]
    assert (await convert(http, server_url=decode, new_role="prefill")).status_code == 200
    sources = set()
    for i in range(12):
        body = {"text": f"after switch {i}", "sampling_params": {"max_new_tokens": 2}}
        reply = await http.post("/generate", json=body)
        assert reply.status_code == 200
        sources.add(reply.json()["meta_info"]["kv_source"])
    assert decode in sources


async def test_two_conversions_at_once_on_the_last_prefills_refuse_one(http):
    first, second = (await arrange(http, prefill=2))["prefill"]
    replies = await asyncio.gather(
        convert(http, server_url=first, new_role="decode"),
        convert(http, server_url=second, new_role="decode"),
    )
    statuses = sorted(r.status_code for r in replies)
    assert statuses == [200, 409]
    refused = next(r for r in replies if r.status_code == 409).json()
    assert refused["error"]["reason"] == "min_prefill"
    assert len((await pools(http))["prefill"]) == 1


async def test_two_conversions_at_once_of_one_worker_refuse_the_second(http):
    decode = (await pools(http))["decode"][0]
    replies = await asyncio.gather(
        convert(http, server_url=decode), convert(http, server_url=decode)
    )
    assert sorted(r.status_code for r in replies) == [200, 409]
    refused = next(r for r in replies if r.status_code == 409).json()
    assert refused["error"]["reason"] == "already_converting"
    entry = await worker_entry(http, decode)
    assert (entry["role"], entry["state"], entry["epoch"]) == ("prefill", "active", 1)


async def test_converting_the_last_prefill_is_refused_and_changes_nothing(http):
    last = (await arrange(http, prefill=1))["prefill"][0]
    before = await worker_entry(http, last)
    response = await convert(http, server_url=last)
    assert response.status_code == 409
    after = await worker_entry(http, last)
    assert [after[k] for k in ("role", "state", "epoch")] == ["prefill", "active", before["epoch"]]
    assert (await http.get("/conversions")).json()["active"] == []


async def test_unknown_worker_is_refused_with_409(http):
    response = await convert(http, server_url="http://127.0.0.1:1")
    assert response.status_code == 409
    assert response.json()["error"]["reason"] == "unknown_worker"


async def test_conversion_to_the_role_the_worker_has_is_refused_with_409(http):
    decode = (await pools(http))["decode"][0]
    response = await convert(http, server_url=decode, new_role="decode")
    assert response.status_code == 409
    assert response.json()["error"]["reason"] == "already_in_role"


async def test_wait_false_answers_202_with_location_of_the_record(http):
    decode = (await pools(http))["decode"][0]
    response = await convert(http, server_url=decode, wait=False)
    assert response.status_code == 202
    location = response.headers["Location"]
    assert location == response.json()["location"] == f"/conversions/{response.json()['id']}"
    for _ in range(500):
        record = (await http.get(location)).json()
        if record["status"] == "succeeded":
            break
        await asyncio.sleep(0.01)
    assert record["status"] == "succeeded"
    assert record["worker_url"] == decode
    assert (record["started_by"], record["replica"]) == ("operator", None)
    assert record["worker_replies"][0]["call"] == "/convert_pd_role"
    assert record["worker_replies"][0]["body"]["success"] is True
    assert all(p["started_at"] <= p["ended_at"] for p in record["phases"])


async def test_history_lists_conversions_newest_first(http):
    decode = (await pools(http))["decode"][0]
    await convert(http, server_url=decode)
    prefill = decode
    await convert(http, server_url=prefill)
    listed = (await http.get("/conversions")).json()["conversions"]
    assert [c["to_role"] for c in listed[:2]] == ["decode", "prefill"]
    assert int(listed[0]["id"][1:]) > int(listed[1]["id"][1:])


async def test_unknown_conversion_id_is_404(http):
    assert (await http.get("/conversions/c999")).status_code == 404
    assert (await http.delete("/conversions/c999")).status_code == 404


async def test_conversion_is_counted_and_timed_in_metrics(http):
    decode = (await pools(http))["decode"][0]
    await convert(http, server_url=decode)
    text = (await http.get("/metrics")).text
    assert (
        'pd_router_conversions_total{from_role="decode",outcome="succeeded",to_role="prefill"} 1.0'
        in text
    )
    for phase in ("drain", "switch", "verify", "total"):
        assert f'pd_router_conversion_phase_seconds_count{{phase="{phase}"}} 1.0' in text


async def test_a_router_that_converted_nothing_exports_every_conversion_series_at_zero(router):
    async with router.client() as client:
        text = (await client.get("/metrics")).text
    outcomes = ("succeeded", "aborted", "drain_timeout", "restored", "failed")
    for from_role, to_role in (("prefill", "decode"), ("decode", "prefill")):
        for outcome in outcomes:
            labels = f'from_role="{from_role}",outcome="{outcome}",to_role="{to_role}"'
            assert f"pd_router_conversions_total{{{labels}}} 0.0" in text
    for phase in ("drain", "switch", "verify", "total"):
        assert f'pd_router_conversion_phase_seconds_count{{phase="{phase}"}} 0.0' in text


async def test_mini_lb_pd_role_switch_answers_with_the_worker_reply(http):
    decode = (await pools(http))["decode"][0]
    response = await http.post(
        "/pd_role_switch", json={"worker_url": decode, "new_role": "prefill"}
    )
    assert response.status_code == 200
    reply = response.json()
    assert reply["success"] is True
    assert (reply["old_role"], reply["new_role"]) == ("decode", "prefill")
    assert decode in (await pools(http))["prefill"]


async def test_mini_lb_same_role_is_success_already_in_target_role(http):
    decode = (await pools(http))["decode"][0]
    response = await http.post("/pd_role_switch", json={"worker_url": decode, "new_role": "decode"})
    assert response.status_code == 200
    assert response.json()["message"] == "already in target role"


async def test_mini_lb_switch_without_drain_on_a_busy_worker_is_400_and_restores(http):
    decodes = (await pools(http))["decode"]
    body = {"text": "long", "sampling_params": {"max_new_tokens": 4000}}
    long_request = asyncio.create_task(http.post("/generate", json=body))
    busy = await wait_for_busy(decodes)
    response = await http.post(
        "/pd_role_switch", json={"worker_url": busy, "new_role": "prefill", "drain": False}
    )
    assert response.status_code == 400
    reply = response.json()
    assert reply["success"] is False and reply["safe_to_restore"] is True
    assert busy in (await pools(http))["decode"]
    assert (await long_request).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"new_role": "decode"}, "worker_url"),
        ({"worker_url": "http://127.0.0.1:1", "new_role": "both"}, "new_role"),
        ({"worker_url": "http://127.0.0.1:1", "new_role": "decode", "drain": "yes"}, "drain"),
    ],
)
async def test_mini_lb_bad_body_is_400_naming_the_field(http, body, field):
    response = await http.post("/pd_role_switch", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["field"] == field


async def test_unknown_field_in_convert_body_is_400(http):
    response = await convert(http, server_url="http://127.0.0.1:1", colour="blue")
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "colour"


async def test_restart_knob_of_pr_9325_body_is_refused_naming_it_and_changes_nothing(http):
    decode = (await pools(http))["decode"][0]
    response = await convert(http, server_url=decode, disable_cuda_graph=True)
    assert response.status_code == 400
    record = response.json()
    assert record["status"] == "restored"
    assert "disable_cuda_graph" in record["message"]
    entry = await worker_entry(http, decode)
    assert (entry["role"], entry["state"], entry["epoch"]) == ("decode", "active", 0)
