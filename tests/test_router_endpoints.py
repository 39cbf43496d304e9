"""Every serving endpoint of the router, through a real router in front of a 2P2D reference
cluster. The decode's output is a function of the KV it pulled, so a correct text proves the
decode was paired with the prefill (and room) holding that prompt."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from pd_worker.tokens import chat_prompt, expected_text, tokenize
from tests.router_helpers import (
    assert_paired,
    generate_body,
    running_router,
    serve_app,
    sse_events,
    wait_until,
)

TOKENS = 4


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=2, speed=0.0)


@pytest.fixture
async def router(cluster):
    async with running_router(cluster) as r:
        yield r


@pytest.fixture
async def http(router):
    async with router.client() as client:
        yield client


async def test_generate_pairs_one_prefill_with_one_decode(http, cluster):
    response = await http.post("/generate", json=generate_body("hello router", TOKENS))
    assert response.status_code == 200
    assert assert_paired(response.json(), "hello router", TOKENS) in cluster.prefill_urls


async def test_request_id_is_echoed_and_forwarded_to_workers_as_rid(http):
    response = await http.post("/generate", json=generate_body("rid check"))
    request_id = response.headers["X-Request-Id"]
    assert response.json()["meta_info"]["id"] == request_id


async def test_client_request_id_is_echoed_and_prefixes_a_unique_rid(http):
    same = {"X-Request-Id": "req-42"}
    responses = await asyncio.gather(
        *(http.post("/generate", json=generate_body(f"id {i}"), headers=same) for i in range(4))
    )
    rids = set()
    for response in responses:
        assert response.status_code == 200
        assert response.headers["X-Request-Id"] == "req-42"
        rids.add(response.json()["meta_info"]["id"])
    assert len(rids) == 4
    assert all(rid.startswith("req-42-") for rid in rids)


async def test_request_without_id_gets_a_fresh_one(http):
    first = await http.post("/generate", json=generate_body("a"))
    second = await http.post("/generate", json=generate_body("a"))
    assert first.headers["X-Request-Id"] != second.headers["X-Request-Id"]


async def test_text_batch_gets_one_room_per_item(http):
    prompts = ["first prompt", "second", "third one here"]
    response = await http.post("/generate", json=generate_body(prompts, TOKENS))
    assert response.status_code == 200
    items = response.json()
    assert len(items) == 3
    for prompt, item in zip(prompts, items, strict=True):
        assert_paired(item, prompt, TOKENS)


async def test_input_ids_batch_gets_one_room_per_item(http):
    rows = [[5, 6, 7], [100, 200], [9]]
    body = {"input_ids": rows, "sampling_params": {"max_new_tokens": TOKENS}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200
    for row, item in zip(rows, response.json(), strict=True):
        assert_paired(item, row, TOKENS)


async def test_single_input_ids_is_not_a_batch(http):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": TOKENS}}
    response = await http.post("/generate", json=body)
    assert_paired(response.json(), [1, 2, 3], TOKENS)


async def test_batch_with_parallel_sampling_pairs_every_sample(http):
    prompts = ["first of two", "second of two"]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": TOKENS, "n": 2}}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200
    items = response.json()
    assert len(items) == 4
    for index, item in enumerate(items):
        assert_paired(item, prompts[index // 2], TOKENS)


async def test_streamed_batch_with_parallel_sampling_pairs_every_sample(http):
    prompts = ["streamed one", "streamed two"]
    body = {
        "text": prompts,
        "stream": True,
        "sampling_params": {"max_new_tokens": TOKENS, "n": 2},
    }
    response = await http.post("/generate", json=body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1, 2, 3]
    for index, event in finals.items():
        assert event["text"] == expected_text(prompts[index // 2], TOKENS)


async def test_generate_stream_relays_events_until_done(http):
    body = generate_body("stream me", TOKENS, stream=True)
    response = await http.post("/generate", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert len(events) == TOKENS + 1
    assert events[-2]["text"] == expected_text("stream me", TOKENS)


async def test_openai_stream_given_as_the_string_true_is_streamed(http):
    body = {"prompt": "lax flag", "max_tokens": TOKENS, "stream": "true"}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_events(response.text)[-1] == "[DONE]"


async def test_batch_stream_relays_every_item(http):
    prompts = ["one", "two"]
    response = await http.post("/generate", json=generate_body(prompts, TOKENS, stream=True))
    finals = {}
    for event in sse_events(response.text)[:-1]:
        finals[event["index"]] = event["text"]
    assert finals == {i: expected_text(p, TOKENS) for i, p in enumerate(prompts)}


async def test_logprobs_of_prefill_are_prepended_to_decode(http):
    prompt = "logprob prompt"
    response = await http.post("/generate", json=generate_body(prompt, TOKENS, return_logprob=True))
    meta = response.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(tokenize(prompt))
    assert [entry[1] for entry in meta["input_token_logprobs"]] == tokenize(prompt)
    assert len(meta["output_token_logprobs"]) == TOKENS


async def test_top_logprobs_of_the_prompt_come_from_the_prefill(http):
    prompt = "top logprob prompt"
    body = generate_body(prompt, TOKENS, return_logprob=True, top_logprobs_num=2)
    meta = (await http.post("/generate", json=body)).json()["meta_info"]
    assert len(meta["input_top_logprobs"]) == len(tokenize(prompt))
    assert len(meta["output_top_logprobs"]) == TOKENS


async def test_logprobs_are_merged_into_every_stream_event(http):
    prompt = "streamed logprobs"
    body = generate_body(prompt, TOKENS, return_logprob=True, stream=True)
    events = sse_events((await http.post("/generate", json=body)).text)
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        assert [e[1] for e in event["meta_info"]["input_token_logprobs"]] == tokenize(prompt)


async def test_logprobs_are_merged_per_batch_item(http):
    prompts = ["ab", "cdef"]
    body = generate_body(prompts, TOKENS, return_logprob=True)
    items = (await http.post("/generate", json=body)).json()
    for prompt, item in zip(prompts, items, strict=True):
        assert [e[1] for e in item["meta_info"]["input_token_logprobs"]] == tokenize(prompt)


async def test_logprobs_asked_per_item_are_merged(http):
    prompts = ["ab", "cdef"]
    body = generate_body(prompts, TOKENS, return_logprob=[True, True])
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    for prompt, item in zip(prompts, response.json(), strict=True):
        assert [e[1] for e in item["meta_info"]["input_token_logprobs"]] == tokenize(prompt)


async def test_logprobs_are_merged_per_item_of_a_streamed_batch(http):
    prompts = ["ab", "cdef"]
    body = generate_body(prompts, TOKENS, return_logprob=True, stream=True)
    events = sse_events((await http.post("/generate", json=body)).text)[:-1]
    assert {e["index"] for e in events} == {0, 1}
    for event in events:
        merged = [e[1] for e in event["meta_info"]["input_token_logprobs"]]
        assert merged == tokenize(prompts[event["index"]])


async def test_completions_with_prompt_list_and_n(http):
    body = {"prompt": ["alpha", "beta"], "max_tokens": TOKENS, "n": 2}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert len(choices) == 4
    texts = sorted(c["text"] for c in choices)
    assert texts == sorted(
        [expected_text("alpha", TOKENS)] * 2 + [expected_text("beta", TOKENS)] * 2
    )


async def test_completions_stream(http):
    body = {"prompt": "stream completion", "max_tokens": TOKENS, "stream": True}
    events = sse_events((await http.post("/v1/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))
    assert text == expected_text("stream completion", TOKENS)


async def test_chat_completions_with_n(http):
    messages = [{"role": "user", "content": "hi there"}]
    body = {"messages": messages, "max_tokens": TOKENS, "n": 2}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert choice["message"]["content"] == expected_text(chat_prompt(messages), TOKENS)


async def test_chat_completions_stream(http):
    messages = [{"role": "user", "content": "stream chat"}]
    body = {"messages": messages, "max_tokens": TOKENS, "stream": True}
    events = sse_events((await http.post("/v1/chat/completions", json=body)).text)
    assert events[-1] == "[DONE]"
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices")
    )
    assert text == expected_text(chat_prompt(messages), TOKENS)


async def test_models_and_model_info_come_from_a_worker(http):
    models = await http.get("/v1/models")
    assert models.status_code == 200
    assert models.json()["data"][0]["id"]
    for path in ("/model_info", "/get_model_info"):
        info = await http.get(path)
        assert info.status_code == 200
        assert "model_path" in info.json()


async def test_server_info_is_aggregated_per_pool(http, cluster):
    for path in ("/server_info", "/get_server_info"):
        info = (await http.get(path)).json()
        assert sorted(e["url"] for e in info["prefill"]) == sorted(cluster.prefill_urls)
        assert sorted(e["url"] for e in info["decode"]) == sorted(cluster.decode_urls)
        assert len(info["internal_states"]) == 2


async def test_server_info_without_a_decode_state_has_mini_lb_stand_in(cluster, free_port):
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_router(cluster, decode=[dead]) as router, router.client() as http:
        info = (await http.get("/server_info")).json()
    assert info["internal_states"] == [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}]


async def test_health_is_always_ok_and_readiness_needs_both_pools(http):
    assert (await http.get("/health")).status_code == 200
    readiness = await http.get("/readiness")
    assert readiness.status_code == 200
    assert readiness.json()["healthy"] == {"prefill": 2, "decode": 2}


async def test_health_generate_asks_every_worker(http):
    response = await http.get("/health_generate")
    assert response.status_code == 200
    assert len(response.json()["workers"]) == 4


async def test_flush_cache_fans_out_to_every_worker(http):
    response = await http.post("/flush_cache", params={"timeout": "1"})
    assert response.status_code == 200
    assert [w["status"] for w in response.json()["workers"]] == [200] * 4


async def test_flush_cache_forwards_its_timeout():
    timeouts: list[str | None] = []

    async def flush(request: web.Request) -> web.Response:
        timeouts.append(request.query.get("timeout"))
        return web.Response(text="Cache flushed.")

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    def recording_worker() -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/flush_cache", flush)
        app.router.add_get("/health", ok)
        app.router.add_get("/server_info", ok)
        return app

    p, d = await serve_app(recording_worker()), await serve_app(recording_worker())
    try:
        async with (
            running_router(prefill=[(p.url, 8998)], decode=[d.url]) as router,
            router.client() as http,
        ):
            assert (await http.post("/flush_cache", params={"timeout": "7.5"})).status_code == 200
    finally:
        await p.stop()
        await d.stop()
    assert timeouts == ["7.5", "7.5"]


async def test_abort_request_fans_out(http):
    response = await http.post("/abort_request", json={"rid": "nothing-running"})
    assert response.status_code == 200
    assert len(response.json()["workers"]) == 4


async def test_metrics_expose_router_series(http):
    await http.post("/generate", json=generate_body("metrics", TOKENS))
    text = (await http.get("/metrics")).text
    assert 'pd_router_requests_total{endpoint="/generate",status="200"}' in text
    for name in (
        "pd_router_request_duration_seconds_bucket",
        "pd_router_ttft_seconds_count",
        "pd_router_worker_inflight",
        "pd_router_worker_healthy",
        "pd_router_pool_size",
        "pd_router_circuit_state",
        "pd_router_worker_state",
    ):
        assert name in text


async def test_worker_inflight_returns_to_zero_after_requests(http, router):
    for i in range(5):
        await http.post("/generate", json=generate_body(f"count {i}", TOKENS))
    await wait_until(
        lambda: all(w.inflight == 0 for w in router.state.registry), 5.0, "in-flight reported 0"
    )


async def test_unknown_route_is_a_json_404(http):
    response = await http.get("/no/such/route")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == 404
