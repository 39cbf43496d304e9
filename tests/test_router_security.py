"""What a client without the admin key can and cannot do to other clients and to the cluster:
abort everyone's requests, flush the workers' caches, guess request ids, read worker details
or worker credentials. Real reference workers and real aiohttp servers behind a real router."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from aiohttp import web

from tests.router_helpers import generate_body, running_router, serve_app, sse_events

KEY = "s3cret-admin-key-9d1e"
AUTH = {"Authorization": f"Bearer {KEY}"}
STREAMS = 16
STREAM_TOKENS = 300  # about 3 s of decoding at speed 1.0


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=1.0)


async def open_streams(http: httpx.AsyncClient, count: int) -> tuple[list[Any], list[str]]:
    """``count`` streaming requests that have all started: (their line iterators, their ids)."""
    streams, ids = [], []
    for i in range(count):
        request = http.build_request(
            "POST", "/generate", json=generate_body(f"stream {i}", STREAM_TOKENS, stream=True)
        )
        response = await http.send(request, stream=True)
        assert response.status_code == 200
        lines = response.aiter_lines()
        first = await anext(lines)
        streams.append((response, first, lines))
        ids.append(response.headers["X-Request-Id"])
    return streams, ids


async def finish_reasons(streams: list[Any]) -> list[str]:
    """Read every stream to its end; the finish reason of each."""
    reasons = []
    for response, first, lines in streams:
        rest = [line async for line in lines]
        await response.aclose()
        events = [e for e in sse_events("\n\n".join([first, *rest])) if e != "[DONE]"]
        reasons.append(events[-1]["meta_info"]["finish_reason"]["type"])
    return reasons


async def test_abort_all_without_the_admin_key_is_refused_and_every_stream_finishes(cluster):
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        streams, _ = await open_streams(http, STREAMS)
        refused = await http.post("/abort_request", json={"abort_all": True})
        reasons = await finish_reasons(streams)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert reasons == ["length"] * STREAMS


async def test_abort_all_with_the_admin_key_aborts_every_stream(cluster):
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        streams, _ = await open_streams(http, STREAMS)
        aborted = await http.post("/abort_request", json={"abort_all": True}, headers=AUTH)
        reasons = await finish_reasons(streams)
    assert aborted.status_code == 200
    assert reasons == ["abort"] * STREAMS


async def test_a_client_aborts_its_own_stream_by_its_request_id_without_the_key(cluster):
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        streams, ids = await open_streams(http, 2)
        aborted = await http.post("/abort_request", json={"rid": ids[0]})
        reasons = await finish_reasons(streams)
    assert aborted.status_code == 200
    assert reasons == ["abort", "length"]


async def test_an_abort_without_the_key_must_name_a_rid_too_long_to_prefix_others(cluster):
    """SGLang aborts every request whose rid starts with the one given: a one-letter rid of
    one's own would abort a sixteenth of everyone's requests."""
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        refused = await http.post("/abort_request", json={"rid": "a"})
        allowed = await http.post("/abort_request", json={"rid": "a"}, headers=AUTH)
    assert refused.status_code == 400
    assert refused.json()["error"]["field"] == "rid"
    assert allowed.status_code == 200


async def test_flush_cache_needs_the_admin_key_when_one_is_set(cluster):
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        refused = await http.post("/flush_cache")
        flushed = await http.post("/flush_cache", headers=AUTH)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert flushed.status_code == 200


async def test_request_ids_share_no_prefix_and_carry_at_least_64_random_bits(cluster):
    async with running_router(cluster) as router, router.client() as http:
        ids = [(await http.get("/health")).headers["X-Request-Id"] for _ in range(50)]
    assert len(set(ids)) == len(ids)
    for request_id in ids:
        assert len(request_id) * 4 >= 64
        int(request_id, 16)
    assert shared_prefix_length(ids) <= 2


def shared_prefix_length(words: list[str]) -> int:
    """How many leading characters all ``words`` have in common."""
    for position, chars in enumerate(zip(*words, strict=False)):
        if len(set(chars)) > 1:
            return position
    return min(map(len, words))


async def test_status_without_the_key_shows_only_what_metrics_shows(cluster):
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        public = (await http.get("/status")).json()
        full = (await http.get("/status", headers=AUTH)).json()
    assert public["redacted"] is True
    assert full["redacted"] is False
    for worker in public["workers"]:
        # convert_refused: why a Convert would be refused (the pools' minimums), not a secret;
        # model: what /metrics shows as pd_router_worker_model.
        assert set(worker) == {
            "id", "url", "role", "model", "state", "healthy", "inflight", "circuit",
            "convert_refused",
        }  # fmt: skip
    assert {"bootstrap_port", "epoch", "last_error"} <= set(full["workers"][0])
    assert public["pools"] == full["pools"]


def leaky_worker(role: str) -> web.Application:
    """A worker whose /server_info, like SGLang's, includes its credentials, at the top level
    and again in ``internal_states[0]``."""
    args = {
        "disaggregation_mode": role,
        "disaggregation_bootstrap_port": 8998,
        "api_key": "worker-api-key",
        "admin_api_key": "worker-admin-key",
        "ssl_keyfile_password": "tls-password",
        "tokenizer_path": "some/model",
    }
    info = {**args, "internal_states": [dict(args)]}

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(info)

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/health", ok)
    return app


async def test_server_info_does_not_hand_on_worker_credentials():
    prefill, decode = (
        await serve_app(leaky_worker("prefill")),
        await serve_app(leaky_worker("decode")),
    )
    try:
        async with (
            running_router(prefill=[(prefill.url, 8998)], decode=[decode.url]) as router,
            router.client() as http,
        ):
            answer = await http.get("/server_info")
    finally:
        await asyncio.gather(prefill.stop(), decode.stop())
    assert answer.status_code == 200
    text = answer.text
    for secret in ("worker-api-key", "worker-admin-key", "tls-password"):
        assert secret not in text
    (entry,) = answer.json()["prefill"]
    assert entry["api_key"] == "<redacted>"
    assert entry["tokenizer_path"] == "some/model"
    assert entry["internal_states"][0]["api_key"] == "<redacted>"
    assert answer.json()["internal_states"][0]["admin_api_key"] == "<redacted>"
