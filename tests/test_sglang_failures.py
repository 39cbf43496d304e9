"""Real SGLang 0.5.23 servers dying behind the router: a decode killed in the middle of a stream,
and a plain SGLang server that dies after a switch (bug a of docs/sglang-bugs.md: launched as a
prefill with its radix cache, it crashes at its first idle after serving decode requests with a
shared prefix). The router ends what was in flight with an error the client can read, takes the
dead worker out at once, and every later request is served by the others.

The module uses the session's fleet and kills two of its servers (a decode and the radix
prefill), so it runs after every other real-SGLang test (marker ends_the_fleet)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.cli_process import Served, serving
from tests.router_helpers import sse_events
from tests.sglang_cluster import Fleet, SGLangServer, pd_args, router_ready

pytestmark = [pytest.mark.real_sglang, pytest.mark.ends_the_fleet]

TIMEOUT = 120.0


@dataclass
class Cluster:
    radix_prefill: SGLangServer  # plain SGLang, radix cache on (SGLang's default)
    prefill: SGLangServer
    decodes: list[SGLangServer]
    router: Served


@pytest.fixture(scope="module")
def cluster(sglang_fleet: Fleet) -> Iterator[Cluster]:
    radix_prefill, prefill = sglang_fleet.radix_prefill, sglang_fleet.prefill[0]
    decodes = sglang_fleet.decode
    args = [*pd_args([radix_prefill, prefill], decodes), "--host", "127.0.0.1"]
    args += ["--health-check-interval-secs", "1", "--decode-policy", "round_robin"]
    with serving(*args) as router:
        router_ready(router.url, prefill=2, decode=2)
        yield Cluster(radix_prefill, prefill, decodes, router)


def workers(router: Served) -> dict[str, dict]:
    entries = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return {w["url"]: w for w in entries}


def generate(url: str, prompt: str, tokens: int = 8) -> httpx.Response:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens}}
    return httpx.post(url + "/generate", json=body, timeout=TIMEOUT)


def test_a_decode_killed_mid_stream_ends_the_stream_with_an_error_event(cluster: Cluster) -> None:
    victim = cluster.decodes[1]
    body = {
        "text": "a long answer streamed to the client",
        "sampling_params": {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True},
        "stream": True,
    }
    chunks: list[bytes] = []
    got_bytes = threading.Event()

    def client() -> None:
        with httpx.stream("POST", cluster.router.url + "/generate", json=body,
                          timeout=TIMEOUT) as reply:  # fmt: skip
            for chunk in reply.iter_bytes():
                chunks.append(chunk)
                got_bytes.set()

    # Round robin over the decodes: requests until one streams from the victim.
    for _ in range(2):
        thread = threading.Thread(target=client)
        started = time.monotonic()
        thread.start()
        assert got_bytes.wait(60), "no byte streamed"
        if workers(cluster.router)[victim.url]["inflight"] > 0:
            break
        thread.join(TIMEOUT)
        chunks.clear()
        got_bytes.clear()
    else:
        pytest.fail(f"no stream went to {victim.name}")
    victim.kill()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    events = sse_events(b"".join(chunks).decode())
    assert events[-1] == "[DONE]"
    assert "error" in events[-2], events[-3:]
    assert time.monotonic() - started < 60
    # The next probe finds nothing listening (one-second probes here).
    deadline = time.monotonic() + 10
    while workers(cluster.router)[victim.url]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers(cluster.router)[victim.url]["healthy"]
    for i in range(4):
        assert generate(cluster.router.url, f"after the kill {i}").status_code == 200


def test_a_server_that_dies_after_a_switch_is_taken_out_cleanly(cluster: Cluster) -> None:
    target = cluster.radix_prefill
    reply = httpx.post(
        cluster.router.url + "/convert_pd_role",
        json={"server_url": target.url, "new_role": "decode"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 200, reply.text
    shared = "The quick brown fox jumps over the lazy dog and sits on the mat"
    statuses = []
    deadline = time.monotonic() + 90
    # Requests whose prompts share a prefix, some decoded by the converted server, until it dies
    # at one of its idles between them.
    while target.alive() and time.monotonic() < deadline:
        statuses += [generate(cluster.router.url, f"{shared} {i}").status_code for i in range(4)]
        time.sleep(0.5)
    assert not target.alive(), "SGLang 0.5.23 did not crash (bug a fixed upstream?)"
    assert "pool memory leak detected" in target.log_text()
    deadline = time.monotonic() + 10
    while workers(cluster.router)[target.url]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not workers(cluster.router)[target.url]["healthy"]
    statuses += [generate(cluster.router.url, f"{shared} after {i}").status_code for i in range(6)]
    assert set(statuses) == {200}, statuses
