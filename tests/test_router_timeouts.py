"""Timeouts that end every request, against reference workers frozen with SIGSTOP (a hung GPU:
the kernel still accepts connections, nothing answers) and a prefill whose stream reports an
abort: the client always gets a complete answer (a retry on another pair before the first byte,
an SSE error event and [DONE] after it), never silence. Health probes are slowed down so that
only the legs' own timeouts act."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator

import pytest

from pd_router.dataplane.legs.connection import WorkerUnavailable
from pd_worker.cluster import WorkerCluster
from pd_worker.tokens import expected_text
from tests.fault_cluster import clear_faults, module_cluster  # noqa: F401 (fixtures)
from tests.router_helpers import (
    assert_paired,
    fault,
    generate_body,
    running_router,
    sse_events,
    wait_until,
    worker_idle,
    worker_metric,
)

TOKENS = 4
SLOW_TOKENS = 300  # about 3 s of decoding at speed 1: long enough to stop a stream midway
LEGS = {"first_byte_timeout_secs": 2.0, "stream_idle_timeout_secs": 1.0}
QUIET = {
    "legs": LEGS,
    "health": {"interval_secs": 30.0},  # a frozen worker stays "healthy": the legs must act
    "prefill_policy": "round_robin",  # the first attempt goes to the first worker listed
    "decode_policy": "round_robin",
}
CLIENT_TIMEOUT = 20.0  # well past every leg timeout above, well below the 1800 s total


cluster = module_cluster(prefill=2, decode=2, speed=1.0)


@contextlib.contextmanager
def frozen(cluster: WorkerCluster, url: str) -> Iterator[None]:
    """``url``'s process stopped (SIGSTOP) inside the block, continued after."""
    process = cluster.worker(url).process
    process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.send_signal(signal.SIGCONT)


def metric(router, name: str, labels: dict[str, str] | None = None) -> float:
    return router.state.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def timeouts(router, role: str) -> float:
    labels = {"role": role, "kind": "timeout"}
    return metric(router, "pd_router_upstream_errors_total", labels)


async def test_decode_frozen_mid_stream_ends_it_with_an_error_event(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    async with (
        running_router(cluster, prefill=[prefill], decode=[decode], **QUIET) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        body = generate_body("frozen stream", SLOW_TOKENS, stream=True)
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data:")
            with frozen(cluster, decode):
                rest = [line async for line in lines]
        events = sse_events("\n\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert (error["type"], error["code"]) == ("upstream_timeout", 504)
        assert decode in error["message"]
        assert timeouts(router, "decode") == 1  # counted against the decode


async def test_decode_frozen_before_its_first_event_is_retried_on_another(cluster):
    prefill = cluster.prefill_urls[0]
    stuck, spare = cluster.decode_urls
    async with (
        running_router(cluster, prefill=[prefill], decode=[stuck, spare], **QUIET) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        with frozen(cluster, stuck):
            body = generate_body("retried stream", TOKENS, stream=True)
            events = sse_events((await http.post("/generate", json=body)).text)
        assert events[-1] == "[DONE]"
        assert events[-2]["text"] == expected_text("retried stream", TOKENS)
        assert metric(router, "pd_router_retries_total") >= 1
        assert timeouts(router, "decode") + timeouts(router, "prefill") >= 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_prefill_frozen_mid_request_is_retried_on_another(cluster, stream):
    stuck, spare = cluster.prefill_urls
    decode = cluster.decode_urls[0]
    await fault(stuck, delay_secs=5.0)  # holds the request long enough to freeze it midway
    async with (
        running_router(cluster, prefill=[stuck, spare], decode=[decode], **QUIET) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        body = generate_body("frozen prefill", TOKENS, stream=stream)
        request = asyncio.create_task(http.post("/generate", json=body))
        await asyncio.sleep(0.3)
        with frozen(cluster, stuck):
            response = await request
        assert response.status_code == 200
        if stream:
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["text"] == expected_text("frozen prefill", TOKENS)
            assert events[-2]["meta_info"]["kv_source"] == spare
        else:
            assert assert_paired(response.json(), "frozen prefill", TOKENS) == spare
        assert timeouts(router, "prefill") >= 1


async def test_total_timeout_on_a_frozen_decode_answers_504(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    async with (
        running_router(
            cluster, prefill=[prefill], decode=[decode], request_timeout_secs=1.5, **QUIET
        ) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        with frozen(cluster, decode):
            response = await http.post("/generate", json=generate_body("too late", TOKENS))
        assert response.status_code == 504
        assert response.json()["error"]["type"] == "upstream_timeout"


# --- a worker that leaves service ends its legs at once ---------------------------------------


async def test_legs_on_a_worker_that_left_service_are_retried_on_another(cluster):
    prefill = cluster.prefill_urls[0]
    stuck, spare = cluster.decode_urls
    async with (
        running_router(cluster, prefill=[prefill], decode=[stuck, spare], **QUIET) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        body = generate_body("moved on", 100)  # a unary decode: only the total bounds it
        request = asyncio.create_task(http.post("/generate", json=body))
        await wait_until(lambda: _busy(stuck), 5.0, "decode started")
        with frozen(cluster, stuck):
            router.dataplane.legs.abort_target(stuck, WorkerUnavailable("worker left service"))
            response = await asyncio.wait_for(request, CLIENT_TIMEOUT)
        assert response.status_code == 200
        assert response.json()["text"] == expected_text("moved on", 100)


async def test_stream_on_a_worker_that_left_service_ends_with_an_error_event(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    async with (
        running_router(cluster, prefill=[prefill], decode=[decode], **QUIET) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        body = generate_body("cut short", SLOW_TOKENS, stream=True)
        async with http.stream("POST", "/generate", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            with frozen(cluster, decode):
                router.dataplane.legs.abort_target(decode, WorkerUnavailable("worker left service"))
                rest = [line async for line in lines]
        events = sse_events("\n\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "upstream_error"
        assert "worker left service" in events[-2]["error"]["message"]


async def _busy(url: str) -> bool:
    return not await worker_idle(url)


# --- a prefill that aborts --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_aborted_prefill_cancels_the_waiting_decode_and_is_retried(cluster_factory, stream):
    cluster = cluster_factory(prefill=1, decode=1, speed=0.0)
    good, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    # Its bootstrap never answers the decode, and it gives up on the KV hand-off after 0.5 s:
    # its answer reports the request aborted (a streamed 200 with an abort event) while the
    # decode would wait for the KV until its own 30 s bootstrap timeout.
    bad = cluster.add("prefill", room_timeout_secs=0.5).url
    await fault(bad, hang_bootstrap=True)
    async with (
        running_router(
            cluster,
            prefill=[bad, good],
            decode=[decode],
            circuit={"failure_threshold": 1, "cooldown_secs": 60.0},
            **QUIET,
        ) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        started = time.monotonic()
        body = generate_body("aborted prefill", TOKENS, stream=stream)
        response = await http.post("/generate", json=body)
        assert response.status_code == 200
        if stream:
            events = sse_events(response.text)
            assert events[-1] == "[DONE]"
            assert events[-2]["meta_info"]["kv_source"] == good
        else:
            assert assert_paired(response.json(), "aborted prefill", TOKENS) == good
        assert time.monotonic() - started < 15.0  # not the decode's 30 s bootstrap timeout
        # The abort is the prefill's failure, not a success (one failure opens the circuit).
        assert router.state.registry.get(bad).circuit.state.value == "open"
        assert await worker_metric(decode, "num_aborted_requests_total") >= 1
        await wait_until(lambda: worker_idle(decode), 5.0, "decode idle")


async def test_decode_frozen_mid_stream_is_ended_when_the_probes_mark_it_unhealthy(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    probes_decide = {
        "legs": {"first_byte_timeout_secs": 60.0, "stream_idle_timeout_secs": 60.0},
        "health": {"interval_secs": 0.2, "timeout_secs": 0.5, "failure_threshold": 2},
    }
    async with (
        running_router(cluster, prefill=[prefill], decode=[decode], **probes_decide) as router,
        router.client(timeout=CLIENT_TIMEOUT) as http,
    ):
        body = generate_body("frozen, then unhealthy", SLOW_TOKENS, stream=True)
        async with http.stream("POST", "/generate", json=body) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            with frozen(cluster, decode):
                rest = [line async for line in lines]
                assert not router.state.registry.get(decode).healthy
        events = sse_events("\n\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        assert decode in events[-2]["error"]["message"]
        assert timeouts(router, "decode") == 0  # ended by the probes' verdict, not a timeout
        await wait_until(lambda: router.state.registry.get(decode).healthy, 10.0, "recovered")
