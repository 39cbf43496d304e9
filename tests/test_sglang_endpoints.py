"""Every generation endpoint through pd-router in front of real SGLang 0.5.23 (2P2D on the CPU,
KV over mooncake TCP) answers token for token what one colocated SGLang server with the same
weights answers. Greedy sampling; the tiny model's weights are real enough that every token
depends on the whole prompt, so a broken KV hand-off shows (tests/sglang_cpu/make_model.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.cli_process import Served, serving
from tests.router_helpers import sse_events
from tests.sglang_cluster import Fleet, router_ready

pytestmark = pytest.mark.real_sglang

TIMEOUT = 120.0
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    " ".join(["the router moves a running server between the pools"] * 12),
]
GREEDY = {"temperature": 0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def router(sglang_fleet: Fleet) -> Iterator[Served]:
    with serving(*sglang_fleet.router_args(), "--host", "127.0.0.1") as served:
        router_ready(served.url, prefill=2, decode=2)
        yield served


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    reply = httpx.post(url + path, json=body, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The SSE events of a streamed answer, ``[DONE]`` excluded."""
    reply = httpx.post(url + path, json={**body, "stream": True}, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    events = sse_events(reply.text)
    assert events and events[-1] == "[DONE]", reply.text[-500:]
    return events[:-1]


def both(fleet: Fleet, router: Served, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    """The colocated server's answer and the router's, to the same body."""
    return post(fleet.reference.url, path, body), post(router.url, path, body)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_generate_matches_colocated(sglang_fleet: Fleet, router: Served, prompt: str) -> None:
    want, got = both(sglang_fleet, router, "/generate", {"text": prompt, "sampling_params": GREEDY})
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"]


def test_generate_batch_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {"text": PROMPTS, "sampling_params": GREEDY}
    want, got = both(sglang_fleet, router, "/generate", body)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_generate_input_ids_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {"input_ids": [[11, 300, 42, 7, 99], [5, 6, 7]], "sampling_params": GREEDY}
    want, got = both(sglang_fleet, router, "/generate", body)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


def test_generate_stream_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {"text": PROMPTS[1], "sampling_params": GREEDY}
    want = post(sglang_fleet.reference.url, "/generate", body)
    events = stream(router.url, "/generate", body)
    assert events[-1]["output_ids"] == want["output_ids"]
    assert events[-1]["text"] == want["text"]


def test_logprobs_are_the_colocated_ones(sglang_fleet: Fleet, router: Served) -> None:
    """Input logprobs come from the prefill, output ones from the decode: together they are
    what one server computes (same token ids, values within float noise)."""
    body = {
        "text": PROMPTS[2],
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    want, got = both(sglang_fleet, router, "/generate", body)
    for key in ("input_token_logprobs", "output_token_logprobs"):
        w, g = want["meta_info"][key], got["meta_info"][key]
        assert [t[1] for t in g] == [t[1] for t in w], key
        assert [t[0] for t in g] == pytest.approx([t[0] for t in w], abs=1e-2, nan_ok=True), key


def test_completions_match_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    want, got = both(sglang_fleet, router, "/v1/completions", body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]


def test_completions_prompt_list_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[:3], "max_tokens": 12, "temperature": 0}
    want, got = both(sglang_fleet, router, "/v1/completions", body)
    assert [c["text"] for c in got["choices"]] == [c["text"] for c in want["choices"]]


def test_completions_stream_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    want = post(sglang_fleet.reference.url, "/v1/completions", body)
    events = stream(router.url, "/v1/completions", body)
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert text == want["choices"][0]["text"]


def test_chat_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 16,
        "temperature": 0,
    }
    want, got = both(sglang_fleet, router, "/v1/chat/completions", body)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]


def test_chat_stream_matches_colocated(sglang_fleet: Fleet, router: Served) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    want = post(sglang_fleet.reference.url, "/v1/chat/completions", body)
    events = stream(router.url, "/v1/chat/completions", body)
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
    )
    assert text == want["choices"][0]["message"]["content"]


def test_requests_go_through_both_pools(sglang_fleet: Fleet, router: Served) -> None:
    """The answers above came through PD, not from one server: every PD server served."""
    for _ in range(8):
        post(router.url, "/generate", {"text": PROMPTS[0], "sampling_params": GREEDY})
    for worker in sglang_fleet.pd:
        metrics = httpx.get(worker.url + "/metrics", timeout=10).text
        served = [
            line
            for line in metrics.splitlines()
            if line.startswith(("sglang:num_requests_total", "sglang_num_requests_total"))
        ]
        assert served and any(float(line.rsplit(" ", 1)[1]) > 0 for line in served), (
            worker.name,
            orjson.dumps(served).decode(),
        )


def test_completions_n2_are_two_colocated_answers(sglang_fleet: Fleet, router: Served) -> None:
    """``n > 1``, which SGLang's PD cannot serve, fanned out by the router: at temperature 0
    each choice is the colocated server's ``n = 1`` answer, the prompt counted once."""
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    want = post(sglang_fleet.reference.url, "/v1/completions", body)
    got = post(router.url, "/v1/completions", {**body, "n": 2})
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert [c["text"] for c in got["choices"]] == [want["choices"][0]["text"]] * 2
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert got["usage"]["completion_tokens"] == 2 * want["usage"]["completion_tokens"]
