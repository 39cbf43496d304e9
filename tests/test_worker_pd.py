"""Prefill/decode pairing through the bootstrap server, and SGLang-style transfer failures.

The decode's output is a function of the KV it pulled over the bootstrap connection, so these
tests can tell which prefill a response came from and whether the pairing was right.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from pd_worker import expected_text
from pd_worker.testing import new_room, pd_generate, poll_until, with_bootstrap

TIMEOUT = 10.0
BOOTSTRAP_TIMEOUT = 0.3


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def two_prefills(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=1)


@pytest.fixture(scope="module")
def short_timeouts(module_cluster_factory):
    return module_cluster_factory(
        prefill=1,
        decode=1,
        bootstrap_timeout_secs=BOOTSTRAP_TIMEOUT,
        room_timeout_secs=BOOTSTRAP_TIMEOUT,
    )


def sse_events(raw: str) -> list[str]:
    return [block[len("data: ") :] for block in raw.split("\n\n") if block.startswith("data: ")]


async def test_decode_reports_the_prefill_it_pulled_kv_from(two_prefills, client):
    decode = two_prefills.decode_urls[0]
    body = {"text": "which prefill?", "sampling_params": {"max_new_tokens": 3}}
    for prefill in two_prefills.prefill_urls:
        port = two_prefills.bootstrap_port(prefill)
        _, d = await pd_generate(client, prefill, decode, port, body)
        assert d.json()["meta_info"]["kv_source"] == prefill


async def test_decode_output_follows_the_prefill_kv_not_its_own_prompt(two_prefills, client):
    prefill, decode = two_prefills.prefill_urls[0], two_prefills.decode_urls[0]
    room = new_room()
    port = two_prefills.bootstrap_port(prefill)
    to_prefill = with_bootstrap({"text": "prompt held by the prefill"}, port, room)
    to_decode = with_bootstrap(
        {"text": "another prompt", "sampling_params": {"max_new_tokens": 5}}, port, room
    )
    p, d = await asyncio.gather(
        client.post(prefill + "/generate", json=to_prefill),
        client.post(decode + "/generate", json=to_decode),
    )
    assert p.status_code == 200
    assert d.json()["text"] == expected_text("prompt held by the prefill", 5)
    assert d.json()["text"] != expected_text("another prompt", 5)


async def test_decode_may_arrive_before_the_prefill(two_prefills, client):
    prefill, decode = two_prefills.prefill_urls[1], two_prefills.decode_urls[0]
    body = with_bootstrap(
        {"text": "late prefill", "sampling_params": {"max_new_tokens": 2}},
        two_prefills.bootstrap_port(prefill),
        new_room(),
    )
    decode_call = asyncio.create_task(client.post(decode + "/generate", json=body))

    async def decode_waits() -> bool:
        return (await client.get(decode + "/pd_role")).json()["num_waiting"] == 1

    await poll_until(decode_waits, "the decode to wait for its prefill")
    p = await client.post(prefill + "/generate", json=body)
    d = await decode_call
    assert p.status_code == 200
    assert d.json()["text"] == expected_text("late prefill", 2)


async def test_concurrent_pairs_each_get_their_own_prompt_output(two_prefills, client):
    decode = two_prefills.decode_urls[0]
    prompts = [f"concurrent prompt {i}" for i in range(12)]

    async def one(i: int, text: str) -> str:
        prefill = two_prefills.prefill_urls[i % 2]
        body = {"text": text, "sampling_params": {"max_new_tokens": 4}}
        _, d = await pd_generate(
            client, prefill, decode, two_prefills.bootstrap_port(prefill), body
        )
        return d.json()["text"]

    texts = await asyncio.gather(*(one(i, t) for i, t in enumerate(prompts)))
    assert texts == [expected_text(t, 4) for t in prompts]


async def test_wrong_bootstrap_port_fails_decode_with_500_after_bootstrap_timeout(
    short_timeouts, client, free_port
):
    decode = short_timeouts.decode_urls[0]
    body = with_bootstrap({"text": "nobody listens"}, free_port(), 4242)
    response = await client.post(decode + "/generate", json=body)
    assert response.status_code == 500
    error = response.json()
    assert error["object"] == "error" and error["code"] == 500
    assert "Decode handshake failed" in error["message"]
    assert "KVTransferError(bootstrap_room=4242)" in error["message"]
    assert "timed out after" in error["message"]


async def test_wrong_bootstrap_host_fails_decode_with_500(short_timeouts, client):
    prefill, decode = short_timeouts.prefill_urls[0], short_timeouts.decode_urls[0]
    body = dict(
        with_bootstrap({"text": "wrong host"}, short_timeouts.bootstrap_port(prefill), new_room()),
        bootstrap_host="127.0.0.2",
    )
    response = await client.post(decode + "/generate", json=body)
    assert response.status_code == 500
    assert "Decode handshake failed" in response.json()["message"]


async def test_room_that_never_appears_fails_decode(short_timeouts, client):
    prefill, decode = short_timeouts.prefill_urls[0], short_timeouts.decode_urls[0]
    body = with_bootstrap(
        {"text": "no such room"}, short_timeouts.bootstrap_port(prefill), new_room()
    )
    response = await client.post(decode + "/generate", json=body)
    assert response.status_code == 500
    assert "KVTransferError" in response.json()["message"]


async def test_unclaimed_prefill_room_is_freed_after_the_room_timeout(short_timeouts, client):
    prefill = short_timeouts.prefill_urls[0]
    body = with_bootstrap({"text": "never pulled"}, short_timeouts.bootstrap_port(prefill), 777)
    response = await client.post(prefill + "/generate", json=body)
    assert response.status_code == 500
    message = response.json()["message"]
    assert "Prefill bootstrap failed" in message
    assert "KVPoll.Bootstrapping" in message
    load = (await client.get(prefill + "/v1/loads")).json()["loads"][0]
    assert load["num_used_tokens"] == 0
    assert (await client.get(prefill + "/pd_role")).json()["idle"] is True


async def test_streaming_decode_failure_ends_with_abort_event_and_done(
    short_timeouts, client, free_port
):
    decode = short_timeouts.decode_urls[0]
    body = with_bootstrap({"text": "stream fail", "stream": True}, free_port(), 99)
    async with client.stream("POST", decode + "/generate", json=body) as response:
        events = sse_events((await response.aread()).decode())
    assert response.status_code == 200
    assert events[-1] == "[DONE]"
    finish = orjson.loads(events[-2])["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 500
    assert "Decode handshake failed" in finish["message"]


async def test_openai_stream_failure_sends_error_chunk(short_timeouts, client, free_port):
    decode = short_timeouts.decode_urls[0]
    body = with_bootstrap({"prompt": "x", "stream": True}, free_port(), 98)
    async with client.stream("POST", decode + "/v1/completions", json=body) as response:
        events = sse_events((await response.aread()).decode())
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 500 and error["type"] == "INTERNAL_SERVER_ERROR"
    assert events[-1] == "[DONE]"


async def test_bootstrap_failures_are_counted_in_metrics(short_timeouts, client, free_port):
    decode = short_timeouts.decode_urls[0]
    await client.post(decode + "/generate", json=with_bootstrap({"text": "m"}, free_port(), 97))
    text = (await client.get(decode + "/metrics")).text
    line = next(
        x for x in text.splitlines() if x.startswith("sglang:num_bootstrap_failed_reqs_total")
    )
    assert float(line.rsplit(" ", 1)[1]) >= 1
