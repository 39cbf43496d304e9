"""pd_worker as a regular (non-disaggregated) server: ``--disaggregation-mode null``.

Such a worker prefills and decodes alone, as SGLang launched without PD does: no bootstrap
server, no KV transfer, no role switch; it reports ``disaggregation_mode: "null"`` and its model
where a router reads them. Its answers are the ones a PD pair gives for the same request.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import orjson
import pytest

from pd_worker.testing import pd_generate, poll_until

TIMEOUT = 10.0
SERVED_NAME = "toy-regular"
MODEL_PATH = "org/toy-regular-weights"
# The slow worker's modeled times: a prefill forward and each decode step.
PREFILL_OVERHEAD_SECS = 0.2
DECODE_STEP_SECS = 0.05


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def regular(module_cluster_factory):
    """One regular worker at speed 0, launched with a model path and a served name (and the
    switch flag, which a regular server cannot use)."""
    cluster = module_cluster_factory(
        prefill=0,
        decode=0,
        regular=1,
        extra_args=("--model-path", MODEL_PATH, "--served-model-name", SERVED_NAME),
    )
    return cluster


@pytest.fixture(scope="module")
def url(regular):
    return regular.regular_urls[0]


@pytest.fixture(scope="module")
def slow(module_cluster_factory):
    """A regular worker in modeled real time: a forward costs PREFILL_OVERHEAD_SECS, a decode
    step DECODE_STEP_SECS."""
    return module_cluster_factory(
        prefill=0,
        decode=0,
        regular=1,
        speed=1.0,
        prefill_secs_per_token=0.0,
        prefill_batch_overhead_secs=PREFILL_OVERHEAD_SECS,
        decode_step_base_secs=DECODE_STEP_SECS,
        decode_step_per_req_secs=0.0,
    )


def sse_events(raw: str) -> list[dict]:
    blocks = [block[len("data: ") :] for block in raw.split("\n\n") if block.startswith("data: ")]
    assert blocks[-1] == "[DONE]"
    return [orjson.loads(block) for block in blocks[:-1]]


async def pd_answer(pd_cluster, client, body: dict) -> tuple[dict, dict]:
    """What a PD pair answers: (prefill body, decode body)."""
    prefill, decode = pd_cluster.prefill_urls[0], pd_cluster.decode_urls[0]
    p, d = await pd_generate(client, prefill, decode, pd_cluster.bootstrap_port(prefill), body)
    assert p.status_code == d.status_code == 200
    return p.json(), d.json()


# ------------------------------------------------------------------- what it reports


async def test_server_info_reports_null_mode_at_the_top_and_in_the_live_state(url, client):
    info = (await client.get(url + "/server_info")).json()
    assert info["disaggregation_mode"] == "null"
    assert info["internal_states"][0]["disaggregation_mode"] == "null"


async def test_server_info_reports_the_model_path_and_the_served_name(url, client):
    info = (await client.get(url + "/server_info")).json()
    assert info["model_path"] == MODEL_PATH
    assert info["served_model_name"] == SERVED_NAME


async def test_model_info_reports_the_model_and_null_mode(url, client):
    info = (await client.get(url + "/model_info")).json()
    assert info["model_path"] == MODEL_PATH
    assert info["served_model_name"] == SERVED_NAME
    assert info["disaggregation_mode"] == "null"


async def test_v1_models_lists_the_served_name(url, client):
    models = (await client.get(url + "/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


async def test_pd_role_reports_null_and_no_switch_even_with_the_switch_flag(url, client):
    role = (await client.get(url + "/pd_role")).json()
    assert role["role"] == "null"
    assert role["switch_supported"] is False
    assert role["bootstrap_port"] is None


async def test_no_bootstrap_server_listens_on_the_bootstrap_port_given(regular, url):
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", regular.bootstrap_port(url)), timeout=1).close()


async def test_health_is_ok(url, client):
    assert (await client.get(url + "/health")).status_code == 200


async def test_metrics_are_served_under_sglang_names(url, client):
    response = await client.get(url + "/metrics")
    assert response.status_code == 200
    assert "sglang:num_running_reqs" in response.text


# ------------------------------------------------------------------- no role switch


def assert_not_disaggregated(response: httpx.Response) -> None:
    """SGLang's refusal of a role change on a regular server: 400, nothing changed."""
    assert response.status_code == 400
    reply = response.json()
    assert reply["success"] is False
    assert reply["message"] == "instance is not running in PD disaggregation mode"
    assert reply["safe_to_restore"] is True
    assert reply["old_role"] == "null"


async def test_a_role_switch_is_refused_as_sglang_refuses_it_on_a_regular_server(url, client):
    response = await client.post(url + "/pd_role_switch", json={"new_role": "decode"})
    assert_not_disaggregated(response)


async def test_a_conversion_is_refused_at_once_without_draining(url, client):
    response = await client.post(url + "/convert_pd_role", json={"new_role": "prefill"})
    assert_not_disaggregated(response)
    assert (await client.get(url + "/pd_role")).json()["draining"] is False


# ------------------------------------------------------------------- generation


async def test_generate_answers_alone_what_a_pd_pair_answers(url, pd_cluster, client):
    body = {"text": "a regular server", "sampling_params": {"max_new_tokens": 6}}
    _, decode = await pd_answer(pd_cluster, client, body)
    alone = (await client.post(url + "/generate", json=body)).json()
    assert alone["output_ids"] == decode["output_ids"]
    assert alone["text"] == decode["text"]
    assert alone["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert "kv_source" not in alone["meta_info"]


async def test_bootstrap_fields_sent_to_a_regular_server_are_ignored(url, client):
    body = {"text": "with a room", "sampling_params": {"max_new_tokens": 3}}
    plain = (await client.post(url + "/generate", json=body)).json()
    addressed = dict(body, bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=7)
    response = await client.post(url + "/generate", json=addressed)
    assert response.status_code == 200
    assert response.json()["output_ids"] == plain["output_ids"]


async def test_a_batch_is_answered_item_by_item(url, pd_cluster, client):
    body = {"text": ["first prompt", "second"], "sampling_params": {"max_new_tokens": 4}}
    _, decode = await pd_answer(pd_cluster, client, body)
    alone = (await client.post(url + "/generate", json=body)).json()
    assert [item["output_ids"] for item in alone] == [item["output_ids"] for item in decode]


async def test_logprobs_are_the_prefills_input_and_the_decodes_output(url, pd_cluster, client):
    body = {"text": "logprobs", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    prefill, decode = await pd_answer(pd_cluster, client, body)
    meta = (await client.post(url + "/generate", json=body)).json()["meta_info"]
    assert meta["input_token_logprobs"] == prefill["meta_info"]["input_token_logprobs"]
    assert meta["output_token_logprobs"] == decode["meta_info"]["output_token_logprobs"]


async def test_logprobs_with_no_new_tokens_still_carry_the_prompts(url, client):
    body = {"text": "ab", "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    meta = (await client.post(url + "/generate", json=body)).json()["meta_info"]
    assert [entry[1] for entry in meta["input_token_logprobs"]] == list(b"ab")
    assert meta["output_token_logprobs"] == []


async def test_streaming_generate_sends_each_token_then_done(url, client):
    body = {"text": "stream me", "sampling_params": {"max_new_tokens": 3}, "stream": True}
    response = await client.post(url + "/generate", json=body)
    events = sse_events(response.text)
    assert [len(event["output_ids"]) for event in events] == [1, 2, 3]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_a_prompt_and_output_beyond_the_kv_capacity_is_refused(
    module_cluster_factory, client
):
    cluster = module_cluster_factory(prefill=0, decode=0, regular=1, max_total_num_tokens=64)
    body = {"input_ids": [1] * 40, "sampling_params": {"max_new_tokens": 40}}
    response = await client.post(cluster.regular_urls[0] + "/generate", json=body)
    assert response.status_code == 400


# ------------------------------------------------------------------- OpenAI routes


async def test_chat_completion_names_the_served_model(url, client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = (await client.post(url + "/v1/chat/completions", json=body)).json()
    assert reply["model"] == SERVED_NAME
    assert reply["usage"]["completion_tokens"] == 3
    assert reply["choices"][0]["finish_reason"] == "length"


async def test_completion_answers_what_a_pd_pair_answers(url, pd_cluster, client):
    body = {"model": SERVED_NAME, "prompt": ["one", "two"], "max_tokens": 4, "logprobs": 1}
    prefill, decode = pd_cluster.prefill_urls[0], pd_cluster.decode_urls[0]
    port = pd_cluster.bootstrap_port(prefill)
    _, pd = await pd_generate(client, prefill, decode, port, body, path="/v1/completions")
    alone = (await client.post(url + "/v1/completions", json=body)).json()
    assert [c["text"] for c in alone["choices"]] == [c["text"] for c in pd.json()["choices"]]
    assert [c["logprobs"]["tokens"] for c in alone["choices"]] == [
        c["logprobs"]["tokens"] for c in pd.json()["choices"]
    ]
    assert alone["model"] == SERVED_NAME


async def test_streaming_completion_names_the_served_model_in_every_chunk(url, client):
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    events = sse_events((await client.post(url + "/v1/completions", json=body)).text)
    assert len(events) == 3
    assert {event["model"] for event in events} == {SERVED_NAME}


# ------------------------------------------------------------------- timing and control


async def test_a_request_takes_a_prefill_forward_then_one_step_per_token(slow, client):
    url = slow.regular_urls[0]
    body = {"text": "timed", "sampling_params": {"max_new_tokens": 4}}
    before = (await client.get(url + "/v1/loads")).json()["loads"][0]
    meta = (await client.post(url + "/generate", json=body)).json()["meta_info"]
    after = (await client.get(url + "/v1/loads")).json()["loads"][0]
    assert meta["e2e_latency"] >= PREFILL_OVERHEAD_SECS + 4 * DECODE_STEP_SECS
    busy_us = after["total_prefill_busy_us"] - before["total_prefill_busy_us"]
    assert busy_us >= PREFILL_OVERHEAD_SECS * 1e6
    assert after["total_prefill_uncached_tokens"] - before["total_prefill_uncached_tokens"] == 5


async def test_loads_count_a_running_request_and_abort_ends_it(slow, client):
    url = slow.regular_urls[0]
    body = {"text": "long", "rid": "long-one", "sampling_params": {"max_new_tokens": 1000}}
    request = asyncio.ensure_future(client.post(url + "/generate", json=body))

    async def running() -> bool:
        loads = (await client.get(url + "/v1/loads")).json()["loads"][0]
        return loads["num_running_reqs"] == 1 and loads["disaggregation"]["mode"] == "null"

    await poll_until(running, "the request to run")
    assert (await client.post(url + "/abort_request", json={"rid": "long-one"})).status_code == 200
    reply = (await request).json()
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"
    idle = (await client.get(url + "/pd_role")).json()["idle"]
    assert idle is True


async def test_flush_cache_succeeds_when_idle(url, client):
    response = await client.post(url + "/flush_cache")
    assert response.status_code == 200
    assert response.text.startswith("Cache flushed.")


# ------------------------------------------------------------------- engines and flags


async def test_the_torch_engine_serves_a_regular_worker(cluster_factory, client):
    cluster = cluster_factory(prefill=0, decode=1, regular=1, engine="torch", kv_transfer="tcp")
    body = {"text": "torch alone", "sampling_params": {"max_new_tokens": 5}}
    alone = (await client.post(cluster.regular_urls[0] + "/generate", json=body)).json()
    local = (await client.post(cluster.decode_urls[0] + "/generate", json=body)).json()
    assert len(alone["output_ids"]) == 5
    assert alone["output_ids"] == local["output_ids"]
