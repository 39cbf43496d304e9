"""Load reporting of the reference worker: SGLang's idle rule, queues under saturation in
/v1/loads, /get_load and /metrics, and /abort_request.

Tests that need work to stay in flight hold it deterministically: a prefill request is busy until
its KV is pulled, and decodes run at speed 1 with a slow decode step, long enough to outlast the
checks, and are aborted once the checks are done.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_worker.prefix_cache import PAGE_SIZE
from pd_worker.testing import new_room, poll_until, with_bootstrap

TIMEOUT = 10.0
STEP_SECS = 0.05
# Requests that would run HOLD_TOKENS steps (3 s; SHARED_HOLD_TOKENS, 1.5 s, when three share
# the 100-token pool) stay running until the test aborts them, so checks made while they run
# hold however slow a loaded machine is; BUSY_TOKENS (1 s) is a request left to finish.
HOLD_TOKENS = 60
SHARED_HOLD_TOKENS = 30
BUSY_TOKENS = 20


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def slow_decode(module_cluster_factory):
    """A decode whose steps take 50 ms, with room for 100 KV tokens and 2 running requests."""
    return module_cluster_factory(
        prefill=0,
        decode=1,
        speed=1.0,
        decode_step_base_secs=STEP_SECS,
        decode_step_per_req_secs=0.0,
        max_total_num_tokens=100,
        max_running_requests=2,
    )


@pytest.fixture(scope="module")
def small_prefill(module_cluster_factory):
    """A prefill with room for 100 KV tokens (speed 0) and a decode to pull from it."""
    return module_cluster_factory(prefill=1, decode=1, max_total_num_tokens=100)


async def load_of(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(url + "/v1/loads")).json()["loads"][0]


async def wait_for(client: httpx.AsyncClient, url: str, check) -> dict:
    """Poll /v1/loads until ``check(load)`` holds (with a deadline); returns that load."""

    async def probe() -> dict | None:
        load = await load_of(client, url)
        return load if check(load) else None

    return await poll_until(probe, f"a load of {url} that passes the check")


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def generate(
    client: httpx.AsyncClient, url: str, text: str, max_new_tokens: int, rid: str | None = None
) -> asyncio.Task:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens}}
    if rid is not None:
        body["rid"] = rid
    return asyncio.create_task(client.post(url + "/generate", json=body))


async def abort(client: httpx.AsyncClient, url: str, **body) -> None:
    """End held requests (``rid=...`` or ``abort_all=True``) once a test has seen them."""
    assert (await client.post(url + "/abort_request", json=body)).status_code == 200


def finish_type(response: httpx.Response) -> str:
    return response.json()["meta_info"]["finish_reason"]["type"]


async def test_decode_is_busy_until_its_last_token(slow_decode, client):
    url = slow_decode.decode_urls[0]
    task = generate(client, url, "busy", BUSY_TOKENS)
    load = await wait_for(client, url, lambda x: x["num_running_reqs"] == 1)
    assert load["num_used_tokens"] == len("busy") + BUSY_TOKENS
    assert (await client.get(url + "/pd_role")).json()["idle"] is False
    response = await task
    assert response.json()["meta_info"]["completion_tokens"] == BUSY_TOKENS
    assert (await client.get(url + "/pd_role")).json()["idle"] is True
    assert (await load_of(client, url))["num_used_tokens"] == 0


async def test_full_kv_pool_queues_requests_in_prealloc(slow_decode, client):
    url = slow_decode.decode_urls[0]
    first = generate(client, url, "a" * 30, HOLD_TOKENS, rid="kv-holder")
    await wait_for(client, url, lambda x: x["num_running_reqs"] == 1)
    second = generate(client, url, "b" * 50, 10)
    load = await wait_for(client, url, lambda x: x["num_waiting_reqs"] == 1)
    assert load["disaggregation"]["decode_prealloc_queue_reqs"] == 1
    assert load["token_usage"] == 0.9
    text = (await client.get(url + "/metrics")).text
    assert metric(text, "sglang:num_queue_reqs") == 1
    assert metric(text, "sglang:num_decode_prealloc_queue_reqs") == 1
    assert metric(text, "sglang:token_usage") == 0.9
    await abort(client, url, rid="kv-holder")
    assert finish_type(await first) == "abort"
    assert finish_type(await second) == "length"


async def test_max_running_requests_holds_extra_requests_in_the_waiting_queue(slow_decode, client):
    url = slow_decode.decode_urls[0]
    tasks = [generate(client, url, f"r{i}", SHARED_HOLD_TOKENS) for i in range(3)]
    load = await wait_for(
        client, url, lambda x: x["num_running_reqs"] == 2 and x["num_waiting_reqs"] == 1
    )
    assert load["queues"]["waiting"] == 1
    get_load = (await client.get(url + "/get_load")).json()
    assert get_load[0]["num_reqs"] == 3 and get_load[0]["num_waiting_reqs"] == 1
    await abort(client, url, abort_all=True)
    responses = await asyncio.gather(*tasks)
    assert [finish_type(r) for r in responses] == ["abort"] * 3
    await wait_for(client, url, lambda x: x["num_used_tokens"] == 0)


async def test_abort_request_ends_a_running_request_with_an_abort_finish_reason(
    slow_decode, client
):
    url = slow_decode.decode_urls[0]
    body = {"text": "abort me", "rid": "abort-me-1", "sampling_params": {"max_new_tokens": 50}}
    task = asyncio.create_task(client.post(url + "/generate", json=body))
    await wait_for(client, url, lambda x: x["num_running_reqs"] == 1)
    assert (
        await client.post(url + "/abort_request", json={"rid": "abort-me-1"})
    ).status_code == 200
    out = (await task).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 50
    await wait_for(client, url, lambda x: x["num_used_tokens"] == 0)


async def test_flush_cache_is_refused_while_busy(slow_decode, client):
    url = slow_decode.decode_urls[0]
    task = generate(client, url, "flush", HOLD_TOKENS, rid="flush-blocker")
    await wait_for(client, url, lambda x: x["num_running_reqs"] == 1)
    response = await client.post(url + "/flush_cache")
    assert response.status_code == 400
    await abort(client, url, rid="flush-blocker")
    assert finish_type(await task) == "abort"


async def test_prefill_is_busy_until_the_decode_pulled_its_kv(small_prefill, client):
    prefill, decode = small_prefill.prefill_urls[0], small_prefill.decode_urls[0]
    body = with_bootstrap(
        {"text": "p" * 20, "sampling_params": {"max_new_tokens": 1}},
        small_prefill.bootstrap_port(prefill),
        new_room(),
    )
    task = asyncio.create_task(client.post(prefill + "/generate", json=body))
    load = await wait_for(
        client, prefill, lambda x: x["disaggregation"]["prefill_inflight_queue_reqs"] == 1
    )
    assert load["num_used_tokens"] == 20
    role = (await client.get(prefill + "/pd_role")).json()
    assert role["idle"] is False and role["num_running"] == 0 and role["num_waiting"] == 0
    text = (await client.get(prefill + "/metrics")).text
    assert metric(text, "sglang:num_prefill_inflight_queue_reqs") == 1
    await client.post(decode + "/generate", json=body)
    assert (await task).status_code == 200
    assert (await client.get(prefill + "/pd_role")).json()["idle"] is True


async def test_prefill_queues_when_its_kv_pool_is_full(small_prefill, client):
    prefill, decode = small_prefill.prefill_urls[0], small_prefill.decode_urls[0]
    port = small_prefill.bootstrap_port(prefill)
    bodies = [
        with_bootstrap({"text": c * 60, "sampling_params": {"max_new_tokens": 1}}, port, new_room())
        for c in "xy"
    ]
    # x first, then y: which one holds the pool decides the order the decodes must come in.
    tasks = [asyncio.create_task(client.post(prefill + "/generate", json=bodies[0]))]
    await wait_for(client, prefill, lambda x: x["num_used_tokens"] == 60)
    tasks.append(asyncio.create_task(client.post(prefill + "/generate", json=bodies[1])))
    load = await wait_for(client, prefill, lambda x: x["num_waiting_reqs"] == 1)
    assert load["num_used_tokens"] == 60
    # One decode after the other: the decode's pool holds one of these requests at a time, and
    # y's decode reserving first would wait on y's KV, which waits on x's pull (a real deadlock).
    for body in bodies:
        assert (await client.post(decode + "/generate", json=body)).status_code == 200
    assert all(r.status_code == 200 for r in await asyncio.gather(*tasks))


@pytest.fixture(scope="module")
def slow_prefill(module_cluster_factory):
    """A prefill whose forwards take 2 s each and hold one 30-token prompt at a time."""
    return module_cluster_factory(
        prefill=1, decode=0, speed=1.0, prefill_batch_overhead_secs=2.0, max_prefill_tokens=30
    )


async def test_prompt_tokens_waiting_for_a_forward_are_reported_as_uncached(slow_prefill, client):
    prefill = slow_prefill.prefill_urls[0]
    port = slow_prefill.bootstrap_port(prefill)
    bodies = [
        with_bootstrap({"text": c * n, "sampling_params": {"max_new_tokens": 1}}, port, new_room())
        for c, n in (("x", 30), ("y", 25), ("z", 12))
    ]
    first = asyncio.create_task(client.post(prefill + "/generate", json=bodies[0]))
    await wait_for(client, prefill, lambda x: x["num_running_reqs"] == 1)
    tasks = [
        first,
        *(asyncio.create_task(client.post(prefill + "/generate", json=b)) for b in bodies[1:]),
    ]
    load = await wait_for(client, prefill, lambda x: x["num_waiting_reqs"] == 2)
    assert load["num_running_reqs"] == 1
    assert load["num_waiting_uncached_tokens"] == 25 + 12
    await abort(client, prefill, abort_all=True)
    await asyncio.gather(*tasks)
    assert (await load_of(client, prefill))["num_waiting_uncached_tokens"] == 0


async def test_queued_prompt_tokens_the_prefix_cache_holds_are_not_uncached(slow_prefill, client):
    prefill = slow_prefill.prefill_urls[0]
    port = slow_prefill.bootstrap_port(prefill)

    def body(text: str) -> dict:
        return with_bootstrap({"text": text, "sampling_params": {"max_new_tokens": 1}}, port,
                              new_room())  # fmt: skip

    warm = asyncio.create_task(client.post(prefill + "/generate", json=body("w" * 30)))
    await wait_for(client, prefill, lambda x: x["disaggregation"]["prefill_inflight_queue_reqs"])
    busy = asyncio.create_task(client.post(prefill + "/generate", json=body("b" * 25)))
    await wait_for(client, prefill, lambda x: x["num_running_reqs"] == 1)
    again = asyncio.create_task(client.post(prefill + "/generate", json=body("w" * 30)))
    load = await wait_for(client, prefill, lambda x: x["num_waiting_reqs"] == 1)
    assert load["num_waiting_uncached_tokens"] == 30 - PAGE_SIZE
    await abort(client, prefill, abort_all=True)
    await asyncio.gather(warm, busy, again)


async def test_metrics_expose_sglang_gauge_and_counter_names(small_prefill, client):
    text = (await client.get(small_prefill.decode_urls[0] + "/metrics")).text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:gen_throughput",
        "sglang:num_prefill_inflight_queue_reqs",
        "sglang:num_decode_transfer_queue_reqs",
        "sglang:num_decode_prealloc_queue_reqs",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
    ):
        assert f"\n{name}{{" in text, name


async def test_client_disconnect_frees_a_waiting_prefill_request(small_prefill):
    prefill = small_prefill.prefill_urls[0]
    body = with_bootstrap({"text": "gone"}, small_prefill.bootstrap_port(prefill), new_room())
    async with httpx.AsyncClient(timeout=TIMEOUT) as leaving:
        task = asyncio.create_task(leaving.post(prefill + "/generate", json=body))
        await wait_for(leaving, prefill, lambda x: x["num_used_tokens"] == len("gone"))
        task.cancel()
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        await wait_for(client, prefill, lambda x: x["num_used_tokens"] == 0)
        assert (await client.get(prefill + "/pd_role")).json()["idle"] is True
