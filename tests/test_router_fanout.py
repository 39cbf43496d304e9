"""Parallel sampling (``n > 1``) on PD: the router sends each sample as a request of its own
(SGLang 0.5.23's PD cannot serve ``n > 1``) and merges the answers into SGLang's ``n > 1``
shape. Through a real router in front of reference workers; a sample's rid names it
(``<request id>-n<sample>``), which proves it went out as a request of its own."""

from __future__ import annotations

import asyncio

import pytest

from pd_router.dataplane.path.fanout import Sampling, merged_usage, sample_bodies
from pd_router.dataplane.path.requests import CHAT, COMPLETIONS, GENERATE
from pd_worker.tokens import chat_prompt, expected_text, tokenize
from tests.fault_cluster import clear_faults, module_cluster  # noqa: F401 (fixtures)
from tests.router_helpers import (
    assert_paired,
    fault,
    running_router,
    settled,
    sse_events,
    wait_until,
    worker_idle,
    worker_metric,
)

TOKENS = 4
SLOW_TOKENS = 300  # about 3 s of decoding at speed 1


cluster = module_cluster(prefill=2, decode=2, speed=0.0)


@pytest.fixture
async def router(cluster):
    async with running_router(cluster) as r:
        yield r


@pytest.fixture
async def http(router):
    async with router.client() as client:
        yield client


@pytest.fixture
def slow_cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=1, speed=1.0)


def sampled(prompt, n: int, tokens: int = TOKENS, **extra):
    return {"text": prompt, "sampling_params": {"max_new_tokens": tokens, "n": n}, **extra}


def retries(router) -> float:
    return router.state.metrics.registry.get_sample_value("pd_router_retries_total") or 0.0


async def aborted(url: str) -> float:
    return await worker_metric(url, "num_aborted_requests_total")


# --- the samples' bodies ------------------------------------------------------------------------


def test_each_sample_asks_for_one_and_gets_a_seed_of_its_own():
    body = sampled("x", 3, sampling_seed=7)
    body["sampling_params"]["sampling_seed"] = 7
    bodies, prompts = sample_bodies(Sampling(GENERATE, body, 3))
    assert prompts is None
    assert [b["sampling_params"]["n"] for b in bodies] == [1, 1, 1]
    assert [b["sampling_params"]["sampling_seed"] for b in bodies] == [7, 8, 9]
    assert body["sampling_params"] == {"max_new_tokens": TOKENS, "n": 3, "sampling_seed": 7}


def test_an_openai_seed_is_derived_per_sample_and_wraps_within_64_bits():
    body = {"prompt": "x", "n": 2, "seed": 2**63 - 1}
    bodies, _ = sample_bodies(Sampling(COMPLETIONS, body, 2))
    assert [(b["n"], b["seed"]) for b in bodies] == [(1, 2**63 - 1), (1, -(2**63))]


def test_per_prompt_sampling_params_each_ask_for_one():
    body = {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2, "temperature": 0.5}]}
    bodies, prompts = sample_bodies(Sampling(GENERATE, body, 2))
    assert prompts == 2
    assert bodies[1]["sampling_params"] == [{"n": 1}, {"n": 1, "temperature": 0.5}]


def test_a_client_rid_names_the_samples_as_sglang_names_the_items():
    single, _ = sample_bodies(Sampling(CHAT, {"messages": [{}], "n": 2, "rid": "r"}, 2))
    assert [b["rid"] for b in single] == ["r_0", "r_1"]
    batch, _ = sample_bodies(Sampling(GENERATE, sampled(["a", "b"], 2, rid="r"), 2))
    assert [b["rid"] for b in batch] == [["r_0", "r_2"], ["r_1", "r_3"]]
    per_prompt, _ = sample_bodies(Sampling(GENERATE, sampled(["a", "b"], 2, rid=["p", "q"]), 2))
    assert [b["rid"] for b in per_prompt] == [["p_0", "q_0"], ["p_1", "q_1"]]


def test_usage_counts_the_prompt_once_and_every_samples_completion():
    usages = [
        {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "reasoning_tokens": 1},
        {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "reasoning_tokens": 2},
    ]
    assert merged_usage(usages) == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "reasoning_tokens": 3,
        "completion_tokens_details": {"reasoning_tokens": 3},
    }


# --- through the router -------------------------------------------------------------------------


async def test_generate_with_n3_answers_three_samples_each_a_request_of_its_own(http):
    response = await http.post("/generate", json=sampled("sample me", 3))
    assert response.status_code == 200
    items = response.json()
    request_id = response.headers["X-Request-Id"]
    assert [item["meta_info"]["id"] for item in items] == [f"{request_id}-n{s}" for s in range(3)]
    for item in items:
        assert_paired(item, "sample me", TOKENS)


async def test_a_batch_with_n2_answers_prompt_major(http):
    prompts = ["first of two", "second of two"]
    response = await http.post("/generate", json=sampled(prompts, 2))
    assert response.status_code == 200
    items = response.json()
    request_id = response.headers["X-Request-Id"]
    assert [item["meta_info"]["id"] for item in items] == [
        f"{request_id}-n{s}_{p}" for p in range(2) for s in range(2)
    ]
    for index, item in enumerate(items):
        assert_paired(item, prompts[index // 2], TOKENS)


async def test_every_sample_carries_the_prefills_input_logprobs(http):
    response = await http.post("/generate", json=sampled("logprobs", 2, return_logprob=True))
    assert response.status_code == 200
    for item in response.json():
        merged = [entry[1] for entry in item["meta_info"]["input_token_logprobs"]]
        assert merged == tokenize("logprobs")


async def test_streamed_generate_with_n3_numbers_the_samples_and_ends_once(http):
    response = await http.post("/generate", json=sampled("streamed", 3, stream=True))
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events.count("[DONE]") == 1
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1, 2]
    request_id = response.headers["X-Request-Id"]
    for index, event in finals.items():
        assert event["meta_info"]["id"] == f"{request_id}-n{index}"
        assert event["text"] == expected_text("streamed", TOKENS)


async def test_completions_with_n2_answer_two_choices_and_the_prompt_counted_once(http):
    body = {"prompt": "complete me", "max_tokens": TOKENS, "n": 2}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["id"] == f"{response.headers['X-Request-Id']}-n0"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert {c["text"] for c in answer["choices"]} == {expected_text("complete me", TOKENS)}
    prompt_tokens = len(tokenize("complete me"))
    assert answer["usage"]["prompt_tokens"] == prompt_tokens
    assert answer["usage"]["completion_tokens"] == 2 * TOKENS
    assert answer["usage"]["total_tokens"] == prompt_tokens + 2 * TOKENS


async def test_completions_with_a_prompt_list_and_n2_number_choices_prompt_major(http):
    prompts = ["alpha", "beta"]
    body = {"prompt": prompts, "max_tokens": TOKENS, "n": 2}
    response = await http.post("/v1/completions", json=body)
    assert response.status_code == 200
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [
        expected_text(prompts[i // 2], TOKENS) for i in range(4)
    ]


async def test_chat_with_n2_answers_two_choices(http):
    messages = [{"role": "user", "content": "hi there"}]
    body = {"messages": messages, "max_tokens": TOKENS, "n": 2}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    answer = response.json()
    assert answer["id"] == f"{response.headers['X-Request-Id']}-n0"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["message"]["content"] == expected_text(chat_prompt(messages), TOKENS)
    assert answer["usage"]["completion_tokens"] == 2 * TOKENS


async def test_streamed_chat_with_n2_interleaves_both_choices_with_one_usage_and_one_done(http):
    messages = [{"role": "user", "content": "stream two"}]
    body = {
        "messages": messages,
        "max_tokens": TOKENS,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events.count("[DONE]") == 1
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    ids = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            ids[choice["index"]] = event["id"]
    assert texts == {i: expected_text(chat_prompt(messages), TOKENS) for i in (0, 1)}
    request_id = response.headers["X-Request-Id"]
    assert ids == {i: f"{request_id}-n{i}" for i in (0, 1)}
    usages = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert len(usages) == 1
    assert usages[0]["completion_tokens"] == 2 * TOKENS


async def test_a_sample_whose_worker_fails_is_retried_alone(cluster, router, http):
    for url in cluster.decode_urls:
        await fault(url, fail_next=1, fail_status=503)
    response = await http.post("/generate", json=sampled("retry a sample", 3))
    assert response.status_code == 200
    items = response.json()
    for item in items:
        assert_paired(item, "retry a sample", TOKENS)
    request_id = response.headers["X-Request-Id"]
    ids = [item["meta_info"]["id"] for item in items]
    assert all(rid.startswith(f"{request_id}-n{s}") for s, rid in enumerate(ids))
    assert ids.count(f"{request_id}-n0") + ids.count(f"{request_id}-n1") < 2
    assert retries(router) == 2


async def test_a_sample_refused_fails_the_request_and_aborts_the_others(slow_cluster):
    prefill, decode = slow_cluster.prefill_urls[0], slow_cluster.decode_urls[0]
    await fault(decode, fail_next=1, fail_status=400)
    async with running_router(slow_cluster) as router, router.client() as http:
        response = await http.post("/generate", json=sampled("one refused", 3, SLOW_TOKENS))
        assert response.status_code == 400
        # Each of the other samples is aborted on the prefill or, once it got there, the decode.
        await wait_until(
            lambda: aborted_on_both_at_least(prefill, decode, 2), 5.0, "the others aborted"
        )
        await settled(router, decode, prefill)


async def test_a_sample_broken_mid_stream_ends_the_stream_with_one_error(slow_cluster):
    decode = slow_cluster.decode_urls[0]
    async with running_router(slow_cluster) as router, router.client() as http:
        body = sampled("doomed samples", 2, SLOW_TOKENS, stream=True)
        async with http.stream("POST", "/generate", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            slow_cluster.kill(decode)
            rest = [line async for line in lines]
        events = sse_events("\n\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        assert events.count("[DONE]") == 1
        errors = [e for e in events[:-1] if "error" in e]
        assert len(errors) == 1
        assert errors[0] == events[-2]
        assert decode in errors[0]["error"]["message"]


async def test_the_client_leaving_cancels_every_sample(slow_cluster):
    prefill, decode = slow_cluster.prefill_urls[0], slow_cluster.decode_urls[0]
    async with running_router(slow_cluster) as router:
        async with router.client() as http:
            body = sampled("abandoned samples", 3, SLOW_TOKENS, stream=True)
            async with http.stream("POST", "/generate", json=body) as response:
                await anext(response.aiter_lines())
        await wait_until(lambda: aborted_at_least(decode, 3), 5.0, "3 samples aborted")
        await settled(router, decode, prefill)


async def test_the_client_leaving_a_unary_request_cancels_every_sample(slow_cluster):
    decode = slow_cluster.decode_urls[0]
    async with running_router(slow_cluster) as router:
        async with router.client() as http:
            request = asyncio.create_task(
                http.post("/generate", json=sampled("gone", 3, SLOW_TOKENS))
            )
            await wait_until(lambda: busy(decode), 5.0, "decode started")
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        await wait_until(lambda: aborted_at_least(decode, 3), 5.0, "3 samples aborted")
        await settled(router, decode)


async def busy(url: str) -> bool:
    return not await worker_idle(url)


async def aborted_at_least(url: str, count: int) -> bool:
    return await aborted(url) >= count


async def aborted_on_both_at_least(prefill: str, decode: str, count: int) -> bool:
    return await aborted(prefill) + await aborted(decode) >= count
