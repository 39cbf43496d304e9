"""In-process role switch (native /pd_role_switch, SGLang 0.5.23 semantics and messages) and the
extension routes (/pd_role, /pd_drain, /convert_pd_role) on the reference worker.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_worker import expected_text
from pd_worker.testing import new_room, pd_generate, poll_until, with_bootstrap

TIMEOUT = 10.0
GRAPH_GB = {"decode_cuda_graph_memory_gb": 1.0}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


async def switch(client: httpx.AsyncClient, url: str, **body) -> tuple[int, dict]:
    response = await client.post(url + "/pd_role_switch", json=body)
    return response.status_code, response.json()


async def internal_state(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(url + "/server_info")).json()["internal_states"][0]


async def hold_prefill_room(
    client: httpx.AsyncClient, cluster, prefill: str
) -> tuple[asyncio.Task, dict]:
    """Start a prefill request nobody pulls yet; returns its task and body (busy until pulled)."""
    body = with_bootstrap(
        {"text": "held", "sampling_params": {"max_new_tokens": 1}},
        cluster.bootstrap_port(prefill),
        new_room(),
    )
    task = asyncio.create_task(client.post(prefill + "/generate", json=body))
    await poll_until(lambda: pd_role_is(client, prefill, "idle", False), "the prefill to be busy")
    return task, body


async def pd_role_is(client: httpx.AsyncClient, url: str, key: str, value: object) -> bool:
    return (await client.get(url + "/pd_role")).json()[key] == value


async def test_switch_is_refused_without_the_flag(cluster_factory, client):
    cluster = cluster_factory(prefill=1, decode=0, enable_pd_role_switch=False)
    status, reply = await switch(client, cluster.prefill_urls[0], new_role="decode", **GRAPH_GB)
    assert status == 400
    assert reply == {
        "rid": None,
        "http_worker_ipc": None,
        "success": False,
        "message": "--enable-pd-role-switch is not set on this server",
        "old_role": "prefill",
        "new_role": "decode",
        "safe_to_restore": True,
    }
    assert (await client.get(cluster.prefill_urls[0] + "/pd_role")).json()[
        "switch_supported"
    ] is False


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    """2 prefills + 1 decode shared by the tests that leave roles as they found them."""
    return module_cluster_factory(prefill=2, decode=1)


async def test_missing_role_reaches_the_scheduler_and_is_rejected_safely(cluster, client):
    status, reply = await switch(client, cluster.prefill_urls[0])
    assert status == 400
    assert reply["message"] == "invalid new_role=''" and reply["safe_to_restore"] is True


@pytest.mark.parametrize("new_role", ["sideways", "Decode", 5])
async def test_role_outside_the_request_type_fails_validation_with_400(cluster, client, new_role):
    status, reply = await switch(client, cluster.prefill_urls[0], new_role=new_role)
    assert status == 400
    assert (reply["object"], reply["type"], reply["code"]) == ("error", "Bad Request", 400)
    assert "new_role" in reply["message"]
    assert (await internal_state(client, cluster.prefill_urls[0]))["disaggregation_mode"] == (
        "prefill"
    )


async def test_validation_error_carries_pydantics_errors_for_the_struct(cluster, client):
    status, reply = await switch(client, cluster.prefill_urls[0], new_role="sideways")
    assert status == 400
    assert reply["message"].startswith(
        "2 validation errors:\n  {'type': 'is_instance_of', 'loc': ('body', "
        "'is-instance[PdRoleSwitchReqInput]'), 'msg': 'Input should be an instance of "
        "PdRoleSwitchReqInput'"
    )
    assert (
        "{'type': 'literal_error', 'loc': ('body', 'function-after[build_struct(), "
        "PdRoleSwitchReqInput]', 'new_role'), 'msg': \"Input should be 'prefill', 'decode' or "
        "''\", 'input': 'sideways'"
    ) in reply["message"]


async def test_unknown_fields_are_ignored_as_msgspec_decoding_ignores_them(cluster, client):
    status, reply = await switch(
        client, cluster.decode_urls[0], new_role="decode", drain=True, future_knob=[1]
    )
    assert status == 200
    assert (reply["success"], reply["message"]) == (True, "ok")


async def test_lax_values_are_coerced_as_pydantic_does(cluster, client):
    status, reply = await switch(
        client, cluster.prefill_urls[0], new_role="decode", decode_cuda_graph_memory_gb="100"
    )
    assert status == 400
    assert "required=100.000 GB" in reply["message"]


REFUSALS = [
    {},
    {"new_role": "decode"},
    {"new_role": "decode", "decode_cuda_graph_memory_gb": -1},
    {"new_role": "decode", "decode_cuda_graph_memory_gb": 100.0},
    {"new_role": "decode", "decode_cuda_graph_bs": [0], **GRAPH_GB},
]


@pytest.mark.parametrize("body", REFUSALS)
async def test_every_refusal_names_both_roles_and_whether_routing_may_resume(cluster, client, body):
    status, reply = await switch(client, cluster.prefill_urls[0], **body)
    assert status == 400
    assert list(reply) == [
        "rid", "http_worker_ipc", "success", "message", "old_role", "new_role", "safe_to_restore"
    ]  # fmt: skip
    assert reply["rid"] is None and reply["http_worker_ipc"] is None
    assert reply["success"] is False and reply["old_role"] == "prefill"
    assert reply["new_role"] == body.get("new_role", "")
    assert reply["safe_to_restore"] is True


async def test_same_role_is_success_without_epoch_change(cluster, client):
    url = cluster.decode_urls[0]
    epoch = (await client.get(url + "/pd_role")).json()["epoch"]
    status, reply = await switch(client, url, new_role="decode")
    assert status == 200
    assert reply["success"] is True and reply["message"] == "ok"
    assert (reply["old_role"], reply["new_role"]) == ("decode", "decode")
    assert (await client.get(url + "/pd_role")).json()["epoch"] == epoch


async def test_busy_prefill_refuses_switch_until_its_kv_was_pulled(cluster, client):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    task, body = await hold_prefill_room(client, cluster, prefill)
    status, reply = await switch(client, prefill, new_role="decode", **GRAPH_GB)
    assert status == 400
    assert reply["message"] == "instance is not idle; drain all requests before switching"
    assert reply["safe_to_restore"] is True
    await client.post(decode + "/generate", json=body)
    assert (await task).status_code == 200
    assert (await client.get(prefill + "/pd_role")).json()["idle"] is True


async def test_first_switch_to_decode_needs_graph_memory(cluster, client):
    status, reply = await switch(client, cluster.prefill_urls[0], new_role="decode")
    assert status == 400
    assert (
        reply["message"] == "decode_cuda_graph_memory_gb is required before capturing decode graphs"
    )
    assert reply["safe_to_restore"] is True


async def test_insufficient_graph_headroom_is_refused_safely(cluster, client):
    status, reply = await switch(
        client, cluster.prefill_urls[0], new_role="decode", decode_cuda_graph_memory_gb=100.0
    )
    assert status == 400
    assert reply["message"] == (
        "insufficient decode CUDA graph headroom: required=100.000 GB, available=8.000 GB"
    )
    assert reply["safe_to_restore"] is True


async def test_negative_graph_memory_is_refused_in_sglangs_words(cluster, client):
    status, reply = await switch(
        client, cluster.prefill_urls[0], new_role="decode", decode_cuda_graph_memory_gb=-1
    )
    assert status == 400 and reply["success"] is False
    assert reply["message"] == "decode_cuda_graph_memory_gb must be non-negative"
    assert reply["safe_to_restore"] is True


async def test_prepare_only_checks_without_switching(cluster, client):
    url = cluster.prefill_urls[0]
    status, reply = await switch(client, url, new_role="decode", prepare_only=True, **GRAPH_GB)
    assert status == 200
    assert reply["message"] == "ready" and reply["safe_to_restore"] is True
    assert (await internal_state(client, url))["disaggregation_mode"] == "prefill"


async def test_switch_keeps_engine_kv_pool_and_bootstrap_server_and_rebuilds_the_role(
    cluster_factory, client
):
    c = cluster_factory(prefill=2, decode=0)
    url, other = c.prefill_urls
    before = (await internal_state(client, url))["pd_worker"]
    status, reply = await switch(
        client, url, new_role="decode", decode_cuda_graph_bs=[1, 2, 4], **GRAPH_GB
    )
    assert status == 200
    assert reply == {
        "rid": None,
        "http_worker_ipc": None,
        "success": True,
        "message": "ok",
        "old_role": "prefill",
        "new_role": "decode",
        "safe_to_restore": False,
    }
    state = await internal_state(client, url)
    after = state["pd_worker"]
    assert after["engine_id"] == before["engine_id"]
    assert after["kv_pool_id"] == before["kv_pool_id"]
    assert after["bootstrap_server_id"] == before["bootstrap_server_id"]
    assert after["role_object_id"] != before["role_object_id"]
    assert state["disaggregation_mode"] == "decode"
    assert state["decode_cuda_graph_bs"] == [1, 2, 4]
    assert state["decode_cuda_graph_memory_gb"] == 1.0
    role = (await client.get(url + "/pd_role")).json()
    assert role["role"] == "decode" and role["epoch"] == 1
    assert role["bootstrap_port"] == c.bootstrap_port(url)
    body = {"text": "served by the converted decode", "sampling_params": {"max_new_tokens": 3}}
    _, d = await pd_generate(client, other, url, c.bootstrap_port(other), body)
    assert d.json()["text"] == expected_text(body["text"], 3)
    assert d.json()["meta_info"]["kv_source"] == other


async def test_switch_back_to_prefill_keeps_captured_graphs_and_serves_kv(cluster_factory, client):
    c = cluster_factory(prefill=0, decode=2)
    url, other = c.decode_urls
    assert (await internal_state(client, url))["decode_cuda_graph_bs"]
    status, reply = await switch(client, url, new_role="prefill")
    assert status == 200 and reply["message"] == "ok"
    state = await internal_state(client, url)
    assert state["disaggregation_mode"] == "prefill"
    assert state["decode_cuda_graph_bs"]
    status, _ = await switch(client, url, new_role="decode")
    assert status == 200
    status, _ = await switch(client, url, new_role="prefill")
    assert (await client.get(url + "/pd_role")).json()["epoch"] == 3
    body = {"text": "kv from a converted prefill", "sampling_params": {"max_new_tokens": 2}}
    _, d = await pd_generate(client, url, other, c.bootstrap_port(url), body)
    assert d.json()["meta_info"]["kv_source"] == url


async def test_second_switch_during_a_switch_is_refused_unsafely(cluster_factory, client):
    c = cluster_factory(prefill=0, decode=1, speed=1.0, switch_secs=1.0)
    url = c.decode_urls[0]
    first = asyncio.create_task(switch(client, url, new_role="prefill"))

    async def switching() -> bool:
        return (await internal_state(client, url))["pd_role_switch_in_progress"]

    await poll_until(switching, "the first switch to be in progress")
    status, reply = await switch(client, url, new_role="prefill")
    assert status == 400
    assert reply["message"] == "another role switch is already in progress"
    assert reply["safe_to_restore"] is False
    assert (await first)[0] == 200


async def test_failed_teardown_leaves_the_worker_unhealthy(cluster_factory, client):
    c = cluster_factory(prefill=1, decode=0)
    url = c.prefill_urls[0]
    await client.post(url + "/fault", json={"fail_next_switch": True})
    status, reply = await switch(client, url, new_role="decode", **GRAPH_GB)
    assert status == 400
    assert reply["message"].startswith("role switch failed; instance unhealthy, restart required:")
    assert reply["safe_to_restore"] is False
    assert (await client.get(url + "/health")).status_code == 503
    assert (await client.post(url + "/generate", json={"text": "x"})).status_code == 503
    status, reply = await switch(client, url, new_role="decode", **GRAPH_GB)
    assert reply["message"] == "instance is unhealthy after a failed role switch; restart required"
    assert reply["safe_to_restore"] is False


async def test_pd_role_reports_extension_status(cluster, client):
    role = (await client.get(cluster.decode_urls[0] + "/pd_role")).json()
    assert set(role) == {
        "role", "bootstrap_port", "idle", "num_running", "num_waiting", "draining", "epoch",
        "switch_supported", "started_at",
    }  # fmt: skip
    assert role["role"] == "decode" and role["switch_supported"] is True


async def test_drain_closes_admission_with_503_and_retry_after(cluster, client):
    url = cluster.decode_urls[0]
    drained = (await client.post(url + "/pd_drain", json={"drain": True})).json()
    assert drained["draining"] is True
    refused = await client.post(url + "/generate", json={"text": "x"})
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    reopened = (await client.post(url + "/pd_drain", json={"drain": False})).json()
    assert reopened["draining"] is False
    assert (await client.post(url + "/generate", json={"text": "x"})).status_code == 200


async def test_convert_drains_in_flight_work_then_switches(cluster_factory, client):
    c = cluster_factory(prefill=1, decode=1)
    prefill, decode = c.prefill_urls[0], c.decode_urls[0]
    task, body = await hold_prefill_room(client, c, prefill)
    convert = asyncio.create_task(
        client.post(prefill + "/convert_pd_role", json={"drain_timeout_secs": 5, **GRAPH_GB})
    )
    await poll_until(lambda: pd_role_is(client, prefill, "draining", True), "the drain to start")
    refused = await client.post(prefill + "/generate", json={"text": "late"})
    assert refused.status_code == 503
    await client.post(decode + "/generate", json=body)
    reply = (await convert).json()
    assert reply["success"] is True
    assert reply["old_role"] == "prefill" and reply["new_role"] == "decode"
    assert reply["bootstrap_port"] == c.bootstrap_port(prefill)
    assert (await task).status_code == 200
    role = (await client.get(prefill + "/pd_role")).json()
    assert role == dict(role, role="decode", epoch=1, draining=False, idle=True)


async def test_convert_drain_timeout_fails_safely_and_reopens_admission(cluster_factory, client):
    c = cluster_factory(prefill=1, decode=1)
    prefill, decode = c.prefill_urls[0], c.decode_urls[0]
    task, body = await hold_prefill_room(client, c, prefill)
    response = await client.post(
        prefill + "/convert_pd_role", json={"drain_timeout_secs": 0.2, **GRAPH_GB}
    )
    assert response.status_code == 400
    reply = response.json()
    assert reply["success"] is False and reply["safe_to_restore"] is True
    assert (await client.get(prefill + "/pd_role")).json()["draining"] is False
    await client.post(decode + "/generate", json=body)
    assert (await task).status_code == 200


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_request_sent_for_the_other_role_is_answered_421_with_the_live_role(
    cluster, client, path
):
    url = cluster.prefill_urls[0]
    body = {"text": "x", "prompt": "x", "model": "m", "max_tokens": 1}
    response = await client.post(url + path, json=body, headers={"X-PD-Role": "decode"})
    assert response.status_code == 421
    assert response.json()["role"] == "prefill"
    assert response.json()["error"]["type"] == "misdirected_request"


async def test_request_sent_for_the_live_role_or_no_known_role_is_served(cluster, client):
    url = cluster.decode_urls[0]
    for header in ("decode", "Decode", "something else"):
        response = await client.post(
            url + "/generate", json={"text": "x"}, headers={"X-PD-Role": header}
        )
        assert response.status_code == 200, header


async def test_role_header_follows_a_switch(cluster_factory, client):
    url = cluster_factory(prefill=1, decode=0).prefill_urls[0]
    as_prefill = {"X-PD-Role": "prefill"}
    assert (
        await client.post(url + "/generate", json={"text": "x"}, headers=as_prefill)
    ).status_code == 200
    await switch(client, url, new_role="decode", **GRAPH_GB)
    moved = await client.post(url + "/generate", json={"text": "x"}, headers=as_prefill)
    assert moved.status_code == 421 and moved.json()["role"] == "decode"


async def test_draining_worker_answers_503_before_checking_the_role(cluster, client):
    url = cluster.decode_urls[0]
    await client.post(url + "/pd_drain", json={"drain": True})
    try:
        response = await client.post(
            url + "/generate", json={"text": "x"}, headers={"X-PD-Role": "prefill"}
        )
    finally:
        await client.post(url + "/pd_drain", json={"drain": False})
    assert response.status_code == 503


async def test_worker_without_extension_routes_ignores_the_role_header(cluster, client):
    url = cluster.decode_urls[0]
    await client.post(url + "/fault", json={"native_only": True})
    try:
        response = await client.post(
            url + "/generate", json={"text": "x"}, headers={"X-PD-Role": "prefill"}
        )
    finally:
        await client.post(url + "/fault", json={"clear": True})
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/convert_pd_role", "/pd_role_switch"])
async def test_a_switch_whose_caller_goes_away_runs_to_its_end(cluster_factory, client, path):
    """As on SGLang's server, a client that disconnects does not cut a role change off half-way
    (a router replica that died mid-conversion leaves the worker in a defined role)."""
    cluster = cluster_factory(prefill=1, decode=1, speed=1.0, switch_secs=1.0)
    url = cluster.prefill_urls[0]
    with pytest.raises(httpx.ReadTimeout):
        await client.post(url + path, json={"new_role": "decode", **GRAPH_GB}, timeout=0.3)

    async def switched() -> bool:
        return (await client.get(url + "/pd_role")).json()["role"] == "decode"

    assert await poll_until(switched, "the role changed", deadline_secs=5.0)
