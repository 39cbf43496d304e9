"""Bad input: a few hundred malformed requests each get a 4xx with a JSON error (never a 500,
never a hang), and the router serves a real request afterwards."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import orjson
import pytest

from tests.router_helpers import assert_paired, generate_body, running_router

MAX_BODY = 64 * 1024
ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
VALID = {
    "/generate": {"text": "ok", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "ok", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "ok"}], "max_tokens": 2},
}
WRONG_VALUES: dict[str, list[Any]] = {
    "text": [5, [], {}, [1], True, 3.5, [None], ["a", 1]],
    "input_ids": ["x", [], {}, [[]], [["a"]], True, [True], [1.5]],
    "sampling_params": ["x", 5, [1], True],
    "stream": ["maybe", 2, [], {}],
    "return_logprob": ["yes", 1, [1], {}],
    "rid": [5, [1], {}, True],
    "prompt": [5, [], {}, [None], True, [["a"]], [1.5]],
    "messages": ["x", [], [1], {}, 5, ["a"]],
    "model": [5, [], {}, True],
    "n": [0, -3, "two", 1.5, True, 10**9],
}
KEYS_OF = {
    "/generate": ["text", "input_ids", "sampling_params", "stream", "return_logprob", "rid"],
    "/v1/completions": ["prompt", "stream", "rid", "model", "n"],
    "/v1/chat/completions": ["messages", "stream", "rid", "model", "n"],
}
RAW_BODIES = [b"", b"{", b"[1,2", b"\xff\xfe\x00", b"nul", b"null", b"[]", b"1", b'"text"', b"true"]


def malformed_requests(rng: random.Random) -> list[tuple[str, str, bytes]]:
    """(method, path, body) triples, each of which must be refused with a 4xx."""
    cases: list[tuple[str, str, bytes]] = []
    for path in ENDPOINTS:
        cases += [("POST", path, raw) for raw in RAW_BODIES]
        cases += [("POST", path, rng.randbytes(rng.randint(1, 200))) for _ in range(40)]
        valid = orjson.dumps(VALID[path])
        cases += [("POST", path, valid[: rng.randint(1, len(valid) - 1)]) for _ in range(15)]
        for key in KEYS_OF[path]:
            for value in WRONG_VALUES[key]:
                body = dict(VALID[path])
                if key == "input_ids":
                    body.pop("text")
                body[key] = value
                cases.append(("POST", path, orjson.dumps(body)))
        for value in WRONG_VALUES["n"]:
            if path == "/generate":
                body = {"text": "ok", "sampling_params": {"max_new_tokens": 2, "n": value}}
                cases.append(("POST", path, orjson.dumps(body)))
        missing = {k: v for k, v in VALID[path].items() if k not in ("text", "prompt", "messages")}
        cases.append(("POST", path, orjson.dumps(missing)))
        cases.append(("POST", path, b'{"text": "' + b"x" * MAX_BODY + b'"}'))
        cases.append(("GET", path, b""))
    cases += [
        ("POST", "/workers", b"{"),
        ("POST", "/workers", b"[]"),
        ("POST", "/workers", orjson.dumps({"url": "http://127.0.0.1:9"})),
        ("DELETE", "/workers/no-such-worker", b""),
        ("DELETE", "/workers", b""),
        ("POST", "/abort_request", b"{{"),
        ("POST", "/abort_request", b"[]"),
    ]
    return cases


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


async def test_malformed_requests_get_a_json_4xx_and_the_router_still_serves(cluster):
    cases = malformed_requests(random.Random(20240601))
    assert len(cases) >= 250
    async with (
        running_router(cluster, max_payload_size=MAX_BODY) as router,
        router.client(timeout=10.0) as http,
    ):

        async def send(case: tuple[str, str, bytes]) -> tuple[tuple[str, str, bytes], int, Any]:
            method, path, body = case
            headers = {"Content-Type": "application/json"}
            response = await http.request(method, path, content=body, headers=headers)
            return case, response.status_code, orjson.loads(response.content)

        for start in range(0, len(cases), 50):
            results = await asyncio.gather(*(send(c) for c in cases[start : start + 50]))
            for case, status, payload in results:
                assert 400 <= status < 500, (case[:2], case[2][:80], status, payload)
                assert isinstance(payload, dict), case
        response = await http.post("/generate", json=generate_body("still alive", 3))
        assert_paired(response.json(), "still alive", 3)
        assert all(w.inflight == 0 for w in router.state.registry)
