"""Models and regular workers against real SGLang 0.5.23 on the CPU: the router reads a real
server's model from its ``/server_info`` and serves a colocated (non-PD) server as a regular
worker, sglang-router's regular mode (``--worker-urls``); the same router serves the 2P2D of the
same model beside it in PD."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.cli_process import serving
from tests.sglang_cluster import Fleet

pytestmark = pytest.mark.real_sglang

TIMEOUT = 120.0
GREEDY = {"temperature": 0, "max_new_tokens": 8}


def ready(url: str, within: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        reply = httpx.get(url + "/readiness", timeout=10)
        if reply.status_code == 200:
            return reply.json()
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.2)


def test_a_real_colocated_server_is_a_regular_worker_of_the_model_it_reports(
    sglang_fleet: Fleet,
) -> None:
    reference = sglang_fleet.reference
    info = httpx.get(reference.url + "/server_info", timeout=10).json()
    with serving("--host", "127.0.0.1", "--worker-urls", reference.url) as router:
        ready(router.url)
        (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
        body = {"text": "The quick brown fox", "sampling_params": GREEDY}
        native = httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT)
        chat = httpx.post(
            router.url + "/v1/chat/completions",
            json={
                "model": worker["model"],
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8,
                "temperature": 0,
            },
            timeout=TIMEOUT,
        )
        models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert (worker["role"], worker["model"]) == ("regular", info["served_model_name"])
    direct = httpx.post(reference.url + "/generate", json=body, timeout=TIMEOUT)
    assert native.status_code == 200, native.text
    assert native.json()["text"] == direct.json()["text"]
    assert chat.status_code == 200, chat.text
    assert [m["id"] for m in models["data"]] == [worker["model"]]


def test_a_real_colocated_server_given_as_a_decode_is_moved_to_the_regular_pool(
    sglang_fleet: Fleet,
) -> None:
    """A colocated server named among the decodes reports ``disaggregation_mode`` null: the
    router serves it as the regular worker it is, and the model's PD pools as before."""
    args = [*sglang_fleet.router_args(), "--decode", sglang_fleet.reference.url]
    with serving(*args, "--host", "127.0.0.1", "--health-check-interval-secs", "1") as router:
        ready(router.url)
        deadline = time.monotonic() + 30
        while True:
            workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
            roles = {w["url"]: w["role"] for w in workers}
            if roles[sglang_fleet.reference.url] == "regular":
                break
            assert time.monotonic() < deadline, roles
            time.sleep(0.2)
        body = {"text": "The capital of France is", "sampling_params": GREEDY}
        answers = [httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT) for _ in "ab"]
    assert [a.status_code for a in answers] == [200, 200]
    assert sorted(roles.values()).count("decode") == len(sglang_fleet.decode)
