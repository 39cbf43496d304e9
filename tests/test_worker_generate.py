"""The reference worker's SGLang-shaped generation routes: /generate (single, batch, streaming),
OpenAI completions and chat, info routes and request errors.

One prefill and one decode process (speed 0) serve the whole module.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from pd_worker import chat_prompt, expected_output_ids, expected_text, tokenize
from pd_worker.cluster import WorkerCluster
from pd_worker.sglang_args import SERVER_ARGS_DEFAULTS
from pd_worker.testing import new_room, pd_generate, poll_until, with_bootstrap
from pd_worker.tokens import detokenize

TIMEOUT = 10.0


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


def sse_events(raw: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [block[len("data: ") :] for block in raw.split("\n\n") if block.startswith("data: ")]


async def stream_post(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, list[str]]:
    async with client.stream("POST", url, json=body) as response:
        raw = (await response.aread()).decode()
        return response.status_code, sse_events(raw)


def ports(cluster: WorkerCluster) -> tuple[str, str, int]:
    prefill = cluster.prefill_urls[0]
    return prefill, cluster.decode_urls[0], cluster.bootstrap_port(prefill)


async def test_health_and_health_generate_answer_200_when_serving(pd_cluster, client):
    for url in pd_cluster.urls:
        assert (await client.get(url + "/health")).status_code == 200
        assert (await client.get(url + "/health_generate")).status_code == 200


async def test_server_info_reports_launch_args_and_live_internal_state(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    info = (await client.get(prefill + "/server_info")).json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == bootstrap_port
    assert info["enable_pd_role_switch"] is True
    assert info["version"] == "0.5.23"
    state = info["internal_states"][0]
    assert state["disaggregation_mode"] == "prefill"
    assert state["decode_cuda_graph_bs"] is None
    alias = (await client.get(decode + "/get_server_info")).json()
    assert alias["internal_states"][0]["disaggregation_mode"] == "decode"
    assert alias["internal_states"][0]["decode_cuda_graph_bs"]


def same_json_type(value, like) -> bool:
    """Whether ``value`` has the JSON type of ``like`` (an int where SGLang gives a float is a
    different type to a typed client)."""
    return like is None or type(value) is type(like)


async def test_server_info_has_every_key_sglang_reports_with_its_type(pd_cluster, client):
    prefill, _, _ = ports(pd_cluster)
    info = (await client.get(prefill + "/server_info")).json()
    state = info["internal_states"][0]
    for key, default in SERVER_ARGS_DEFAULTS.items():
        assert same_json_type(info[key], default), key
        assert same_json_type(state[key], default), key
    assert info["status"] == "ready" and info["frontend"] == "python"
    assert {"launch_command", "kv_events", "hicache_object_layout"} <= set(info)
    assert info["max_req_input_len"] < info["max_total_num_tokens"]
    assert isinstance(info["startup_time"]["tokenizer_e2e"], float)
    assert isinstance(state["world_size"], int)
    assert set(state["startup_time"]) == {
        "load_weight",
        "kv_cache_allocation",
        "scheduler_e2e",
        "cuda_graph",
    }
    graph_phases = {
        "prefill",
        "decode",
        "target_verify",
        "draft_prefill",
        "draft_decode",
        "draft_extend",
    }
    assert set(state["startup_time"]["cuda_graph"]) == graph_phases
    memory = state["memory_usage"]
    assert set(memory) == {
        "weight",
        "kvcache",
        "startup_available",
        "token_capacity",
        "token_capacity_swa",
        "graph",
    }
    assert set(memory["graph"]) == graph_phases
    assert all(isinstance(v, float) for v in memory["graph"].values())
    assert memory["token_capacity"] == info["max_total_num_tokens"]


async def test_model_info_has_every_key_sglang_reports(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    info = (await client.get(decode + "/model_info")).json()
    assert set(info) == {
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
        "load_format",
        "reasoning_parser",
        "tool_call_parser",
        "disaggregation_mode",
        "has_image_understanding",
        "has_audio_understanding",
        "model_type",
        "architectures",
    }
    assert info["disaggregation_mode"] == "decode"


async def test_model_info_and_v1_models_name_the_served_model(pd_cluster, client):
    prefill, _, _ = ports(pd_cluster)
    info = (await client.get(prefill + "/model_info")).json()
    models = (await client.get(prefill + "/v1/models")).json()
    assert info["is_generation"] is True
    assert models["object"] == "list"
    assert models["data"][0]["id"] == info["served_model_name"]


async def test_paired_generate_returns_decode_text_derived_from_prefill_kv(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 12}}
    p, d = await pd_generate(client, prefill, decode, bootstrap_port, body)
    assert p.status_code == 200 and d.status_code == 200
    out = d.json()
    assert out["text"] == expected_text("The capital of France is", 12)
    assert out["output_ids"] == expected_output_ids(tokenize("The capital of France is"), 12)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(tokenize("The capital of France is"))
    assert meta["completion_tokens"] == 12
    assert meta["kv_source"] == prefill
    assert meta["e2e_latency"] >= 0
    assert p.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_input_ids_prompt_gives_same_output_as_equivalent_text(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {"input_ids": tokenize("abc"), "sampling_params": {"max_new_tokens": 4}}
    _, d = await pd_generate(client, prefill, decode, bootstrap_port, body)
    assert d.json()["text"] == expected_text("abc", 4)


async def test_stop_string_trims_text_and_reports_stop(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    full = expected_text("stop test", 8)
    stop_word = full.split()[3]
    body = {"text": "stop test", "sampling_params": {"max_new_tokens": 8, "stop": [stop_word]}}
    _, d = await pd_generate(client, prefill, decode, bootstrap_port, body)
    out = d.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_word}
    assert out["text"] == full[: full.find(stop_word)]


async def test_batch_text_with_per_item_rooms_returns_a_list(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    texts = ["first prompt", "second prompt", "third"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 5}}
    rooms = [new_room() for _ in texts]
    p, d = await pd_generate(client, prefill, decode, bootstrap_port, body, room=rooms)
    assert p.status_code == 200 and len(p.json()) == 3
    assert [o["text"] for o in d.json()] == [expected_text(t, 5) for t in texts]


async def test_batch_input_ids_2d_is_a_batch(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    ids = [tokenize("x y"), tokenize("z")]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}}
    _, d = await pd_generate(
        client, prefill, decode, bootstrap_port, body, room=[new_room(), new_room()]
    )
    assert [o["output_ids"] for o in d.json()] == [expected_output_ids(i, 3) for i in ids]


async def test_sampling_n_expands_one_prompt_into_a_batch(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {"text": "twice", "sampling_params": {"max_new_tokens": 2, "n": 2}}
    rooms = [new_room(), new_room()]
    _, d = await pd_generate(client, prefill, decode, bootstrap_port, body, room=rooms)
    assert [o["text"] for o in d.json()] == [expected_text("twice", 2)] * 2


async def test_parallel_sampling_reads_one_room_per_prompt_as_sglang_does(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    texts = ["first prompt", "second prompt"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 2, "n": 3}}
    rooms = [new_room(), new_room()]
    p, d = await pd_generate(client, prefill, decode, bootstrap_port, body, room=rooms)
    assert p.status_code == 200 and d.status_code == 200
    assert [o["text"] for o in d.json()] == [expected_text(t, 2) for t in texts for _ in "abc"]


async def test_single_request_keeps_its_rid_as_meta_info_id(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"text": "named", "rid": "solo-rid", "sampling_params": {"max_new_tokens": 1}}
    response = await client.post(decode + "/generate", json=body)
    assert response.json()["meta_info"]["id"] == "solo-rid"


async def test_batch_string_rid_expands_to_rid_underscore_index(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"text": ["a", "b", "c"], "rid": "batch", "sampling_params": {"max_new_tokens": 1}}
    response = await client.post(decode + "/generate", json=body)
    assert response.status_code == 200
    assert [o["meta_info"]["id"] for o in response.json()] == ["batch_0", "batch_1", "batch_2"]


async def test_batch_rid_list_names_each_prompt(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"text": ["a", "b"], "rid": ["ra", "rb"], "sampling_params": {"max_new_tokens": 1}}
    response = await client.post(decode + "/generate", json=body)
    assert [o["meta_info"]["id"] for o in response.json()] == ["ra", "rb"]


async def test_parallel_samples_get_fresh_rids_like_sglang(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {
        "text": ["a", "b"],
        "rid": ["ra", "rb"],
        "sampling_params": {"max_new_tokens": 1, "n": 2},
    }
    response = await client.post(decode + "/generate", json=body)
    ids = [o["meta_info"]["id"] for o in response.json()]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert not {"ra", "rb"} & set(ids)


async def test_scalar_room_on_a_batch_counts_up_per_item(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    texts = ["one room", "next room"]
    body = {"text": texts, "sampling_params": {"max_new_tokens": 3}}
    p, d = await pd_generate(client, prefill, decode, bootstrap_port, body, room=new_room())
    assert p.status_code == 200 and d.status_code == 200
    assert [o["text"] for o in d.json()] == [expected_text(t, 3) for t in texts]
    assert all(o["meta_info"]["kv_source"] == prefill for o in d.json())


async def test_openai_id_is_the_rid_of_the_single_item(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"prompt": "id me", "max_tokens": 1, "rid": "cmpl-mine"}
    response = await client.post(decode + "/v1/completions", json=body)
    assert response.json()["id"] == "cmpl-mine"
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert len((await client.post(decode + "/v1/chat/completions", json=chat)).json()["id"]) == 32


async def test_openai_batch_string_rid_expands_like_generate(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"prompt": ["p0", "p1"], "max_tokens": 2, "rid": "multi", "stream": True}
    _, events = await stream_post(client, decode + "/v1/completions", body)
    chunks = [orjson.loads(e) for e in events[:-1]]
    ids = {c["choices"][0]["index"]: c["id"] for c in chunks}
    assert ids == {0: "multi_0", 1: "multi_1"}
    unary = await client.post(decode + "/v1/completions", json=dict(body, stream=False))
    assert unary.json()["id"] == "multi_0"


async def test_streaming_generate_sends_cumulative_events_then_done(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 4}}
    status, events = await stream_post(client, decode + "/generate", body)
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert chunks[-1]["text"] == expected_text("stream me", 4)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


async def test_streaming_batch_events_carry_the_item_index(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {"text": ["a", "b"], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    _, events = await stream_post(client, decode + "/generate", body)
    chunks = [orjson.loads(e) for e in events[:-1]]
    finals = {c["index"]: c["text"] for c in chunks if c["meta_info"]["finish_reason"]}
    assert finals == {0: expected_text("a", 2), 1: expected_text("b", 2)}


async def test_prefill_return_logprob_gives_input_token_logprobs(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {"text": "logp", "return_logprob": True, "sampling_params": {"max_new_tokens": 3}}
    p, d = await pd_generate(client, prefill, decode, bootstrap_port, body)
    input_logprobs = p.json()["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in input_logprobs] == tokenize("logp")
    assert input_logprobs[0][0] is None
    assert len(d.json()["meta_info"]["output_token_logprobs"]) == 3


async def test_completions_n2_gives_two_choices_and_usage(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {"model": "m", "prompt": "Say hi", "max_tokens": 6, "n": 2}
    _, d = await pd_generate(
        client,
        prefill,
        decode,
        bootstrap_port,
        body,
        path="/v1/completions",
        room=[new_room(), new_room()],
    )
    out = d.json()
    assert out["object"] == "text_completion"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["text"] == expected_text("Say hi", 6) for c in out["choices"])
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    prompt_tokens = len(tokenize("Say hi"))
    assert out["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": prompt_tokens + 12,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


async def test_completions_stream_deltas_add_up_and_usage_chunk_comes_last(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    body = {
        "prompt": "deltas",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, events = await stream_post(client, decode + "/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected_text("deltas", 5)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_chat_completion_uses_the_chat_template_prompt(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    messages = [{"role": "user", "content": "Hello there"}]
    body = {"model": "m", "messages": messages, "max_tokens": 7}
    _, d = await pd_generate(
        client, prefill, decode, bootstrap_port, body, path="/v1/chat/completions"
    )
    out = d.json()
    assert out["object"] == "chat.completion"
    message = out["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == expected_text(chat_prompt(messages), 7)
    assert out["usage"]["prompt_tokens"] == len(tokenize(chat_prompt(messages)))


async def test_chat_stream_announces_role_then_content_deltas(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    messages = [{"role": "user", "content": "stream chat"}]
    body = {"messages": messages, "max_tokens": 3, "stream": True}
    _, events = await stream_post(client, decode + "/v1/chat/completions", body)
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert content == expected_text(chat_prompt(messages), 3)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_meta_info_logprobs_carry_top_logprobs_lengths_and_token_text(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {
        "text": "top",
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 3},
    }
    p, d = await pd_generate(client, prefill, decode, bootstrap_port, body)
    prefill_meta, meta = p.json()["meta_info"], d.json()["meta_info"]
    assert meta["output_token_logprobs_length"] == 3
    ids = d.json()["output_ids"]
    assert [(e[1], e[2]) for e in meta["output_token_logprobs"]] == [
        (i, detokenize([i])) for i in ids
    ]
    assert [len(row) for row in meta["output_top_logprobs"]] == [2, 2, 2]
    assert [row[0][1] for row in meta["output_top_logprobs"]] == ids
    assert meta["input_top_logprobs"] == []
    assert [e[2] for e in prefill_meta["input_token_logprobs"]] == list("top")
    assert prefill_meta["input_top_logprobs"][0] is None
    assert [len(row) for row in prefill_meta["input_top_logprobs"][1:]] == [2, 2]


async def test_completion_logprobs_are_filled_when_asked(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = {"model": "m", "prompt": "lp", "max_tokens": 3, "logprobs": 2}
    _, d = await pd_generate(client, prefill, decode, bootstrap_port, body, path="/v1/completions")
    choice = d.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [-1, -1, -1]
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"])
    assert [len(top) for top in logprobs["top_logprobs"]] == [2, 2, 2]


async def test_chat_logprobs_are_filled_in_responses_and_stream_chunks(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    messages = [{"role": "user", "content": "chat logprobs"}]
    body = {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    _, d = await pd_generate(
        client, prefill, decode, bootstrap_port, body, path="/v1/chat/completions"
    )
    choice = d.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    assert all(t["bytes"] == list(t["token"].encode()) for t in content)
    assert all(len(t["top_logprobs"]) == 1 for t in content)

    paired = with_bootstrap(dict(body, stream=True), bootstrap_port, new_room())
    _, (_, events) = await asyncio.gather(
        client.post(prefill + "/v1/chat/completions", json=paired),
        stream_post(client, decode + "/v1/chat/completions", paired),
    )
    chunks = [orjson.loads(e) for e in events[:-1]]
    streamed = [
        t["token"]
        for c in chunks
        if c["choices"][0]["logprobs"] is not None
        for t in c["choices"][0]["logprobs"]["content"]
    ]
    assert "".join(streamed) == choice["message"]["content"]


# Errors SGLang finds while generating (ValueError in GenerateReqInput's normalization or the
# tokenizer manager's checks): 400 {"error": {"message"}}, or an error event in a 200 stream.
REQUEST_ERRORS = [
    ({}, "Either text, input_ids or input_embeds should be provided."),
    ({"text": "x", "input_ids": [1]}, "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": []}, "input_ids cannot be empty."),
    ({"text": ["a", "b"], "bootstrap_room": [1]}, "bootstrap_room has 1 entries for 2 prompts"),
    ({"text": ["a", "b"], "rid": ["r"]}, "rids length mismatch with the batch_size"),
    ({"text": ["a", "b"], "rid": ["r", "r"]}, "Duplicate request IDs"),
    ({"text": "a", "rid": ["r"]}, "The rid should be a string for a single request"),
    ({"text": "a", "bootstrap_room": 5}, "bootstrap_host and bootstrap_port are required"),
]
# Fields of the wrong type, refused by SGLang's contract gate before any stream opens:
# 400 {"error": "<violation>"}.
CONTRACT_ERRORS = [
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "a", "bootstrap_port": 70000, "bootstrap_room": 1}, "bootstrap_port must be"),
    ({"input_ids": [2**40]}, "input_ids must be"),
]


@pytest.mark.parametrize(("body", "fragment"), REQUEST_ERRORS)
async def test_request_error_is_400_with_error_message(pd_cluster, client, body, fragment):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/generate", json=body)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "fragment"), REQUEST_ERRORS)
async def test_request_error_of_a_stream_is_an_error_event_then_done(
    pd_cluster, client, body, fragment
):
    _, decode, _ = ports(pd_cluster)
    status, events = await stream_post(client, decode + "/generate", dict(body, stream=True))
    assert status == 200
    assert events[-1] == "[DONE]" and len(events) == 2
    error = orjson.loads(events[0])["error"]
    assert fragment in error["message"]
    assert (error["code"], error["retryable"]) == (400, False)


@pytest.mark.parametrize(("body", "fragment"), CONTRACT_ERRORS)
@pytest.mark.parametrize("stream", [False, True])
async def test_wrong_field_type_is_400_before_any_stream(
    pd_cluster, client, body, fragment, stream
):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/generate", json=dict(body, stream=stream))
    assert response.status_code == 400
    assert fragment in response.json()["error"]


@pytest.mark.parametrize(
    ("stream", "violation"),
    [
        ("yes", 'invalid type: string "yes", expected a boolean'),
        (1, "invalid type: integer `1`, expected a boolean"),
    ],
)
async def test_stream_that_is_not_a_json_boolean_is_refused_in_the_contract_gates_words(
    pd_cluster, client, stream, violation
):
    """pydantic takes "yes" and 1 for true; the contract gate, which runs before the prompt is
    looked at, does not."""
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/generate", json={"stream": stream})
    assert (response.status_code, response.json()) == (400, {"error": violation})


# Bodies that do not fit GenerateReqInput's field types: FastAPI's validation answers them
# before SGLang's handler runs, 400 in the ErrorResponse shape with pydantic's errors.
VALIDATION_ERRORS = [
    (
        {"text": 5},
        "2 validation errors:\n"
        "  {'type': 'string_type', 'loc': ('body', 'text', 'str'), "
        "'msg': 'Input should be a valid string', 'input': 5}\n"
        "  {'type': 'list_type', 'loc': ('body', 'text', 'list[str]'), "
        "'msg': 'Input should be a valid list', 'input': 5}",
    ),
    (
        {"text": "x", "stream": "maybe"},
        "1 validation error:\n"
        "  {'type': 'bool_parsing', 'loc': ('body', 'stream'), "
        "'msg': 'Input should be a valid boolean, unable to interpret input', 'input': 'maybe'}",
    ),
    (
        [1],
        "1 validation error:\n"
        "  {'type': 'dataclass_type', 'loc': ('body',), 'msg': 'Input should be a dictionary "
        "or an instance of GenerateReqInput', 'input': [1], "
        "'ctx': {'class_name': 'GenerateReqInput'}}",
    ),
]


@pytest.mark.parametrize(("body", "text"), VALIDATION_ERRORS)
async def test_body_outside_the_request_type_is_a_fastapi_validation_error(
    pd_cluster, client, body, text
):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/generate", json=body)
    assert response.status_code == 400
    reply = response.json()
    assert (reply["object"], reply["type"], reply["param"], reply["code"]) == (
        "error",
        "Bad Request",
        None,
        400,
    )
    assert reply["message"].startswith(text + " [{")


OPENAI_VALIDATION_ERRORS = [
    (
        "/v1/completions",
        {"prompt": "x", "max_tokens": -1},
        "1 validation error:\n"
        "  {'type': 'value_error', 'loc': ('body', 'max_tokens'), "
        "'msg': 'Value error, max_tokens must be positive', 'input': -1, "
        "'ctx': {'error': ValueError('max_tokens must be positive')}}",
    ),
    (
        "/v1/completions",
        {"model": "m"},
        "1 validation error:\n"
        "  {'type': 'missing', 'loc': ('body', 'prompt'), 'msg': 'Field required', "
        "'input': {'model': 'm'}}",
    ),
    (
        "/v1/chat/completions",
        {"messages": "hi"},
        "1 validation error:\n"
        "  {'type': 'list_type', 'loc': ('body', 'messages'), "
        "'msg': 'Input should be a valid list', 'input': 'hi'}",
    ),
]


@pytest.mark.parametrize(("path", "body", "text"), OPENAI_VALIDATION_ERRORS)
async def test_openai_body_outside_the_request_model_is_a_fastapi_validation_error(
    pd_cluster, client, path, body, text
):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + path, json=body)
    assert response.status_code == 400
    reply = response.json()
    assert (reply["object"], reply["type"], reply["code"]) == ("error", "Bad Request", 400)
    assert reply["message"].startswith(text + " [{")


async def test_malformed_json_is_a_fastapi_json_invalid_error(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/generate", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["message"].startswith(
        "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body', 1), "
        "'msg': 'JSON decode error', 'input': {}, "
        "'ctx': {'error': 'Expecting property name enclosed in double quotes'}}"
    )


async def test_invalid_openai_body_is_400_in_openai_error_shape(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/v1/chat/completions", json={"messages": []})
    assert response.status_code == 400
    body = response.json()
    assert body["object"] == "error" and body["code"] == 400 and "messages" in body["message"]


async def test_prompt_longer_than_kv_capacity_is_rejected_with_400(module_cluster_factory, client):
    cluster = module_cluster_factory(prefill=0, decode=1, max_total_num_tokens=64)
    response = await client.post(cluster.decode_urls[0] + "/generate", json={"text": "x" * 100})
    assert response.status_code == 400
    assert "longer than the KV capacity" in response.json()["error"]["message"]


async def test_flush_cache_succeeds_when_idle(pd_cluster, client):
    _, decode, _ = ports(pd_cluster)
    response = await client.post(decode + "/flush_cache")
    assert response.status_code == 200
    assert response.text.startswith("Cache flushed")


async def test_prefill_without_room_serves_alone(pd_cluster, client):
    prefill, _, _ = ports(pd_cluster)
    response = await client.post(prefill + "/generate", json={"text": "solo"})
    assert response.status_code == 200
    assert response.json()["meta_info"]["completion_tokens"] == 1


async def wait_until_busy(client: httpx.AsyncClient, url: str) -> None:
    async def busy() -> bool:
        return not (await client.get(url + "/pd_role")).json()["idle"]

    await poll_until(busy, f"{url} to be busy")


async def test_same_room_twice_on_a_prefill_is_rejected(pd_cluster, client):
    prefill, decode, bootstrap_port = ports(pd_cluster)
    body = with_bootstrap(
        {"text": "dup", "sampling_params": {"max_new_tokens": 1}}, bootstrap_port, new_room()
    )
    first = asyncio.create_task(client.post(prefill + "/generate", json=body))
    await wait_until_busy(client, prefill)
    second = await client.post(prefill + "/generate", json=body)
    assert second.status_code == 400
    assert "already in use" in second.json()["error"]["message"]
    await client.post(decode + "/generate", json=body)
    assert (await first).status_code == 200
