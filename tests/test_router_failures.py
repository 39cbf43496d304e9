"""Failure paths of the request path, against real reference workers with injected faults or
killed processes: retries with a new pair before the first byte, fast cancellation of the other
leg, pass-through of client errors, SSE error events after the first byte, and aborts when the
client goes away."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from pd_worker.tokens import expected_text
from tests.fault_cluster import clear_faults, module_cluster  # noqa: F401 (fixtures)
from tests.router_helpers import (
    assert_paired,
    fault,
    generate_body,
    running_router,
    settled,
    sse_events,
    wait_until,
    worker_idle,
    worker_metric,
)

TOKENS = 4
SLOW_TOKENS = 300  # about 3 s of decoding at speed 1: long enough to break a stream midway


cluster = module_cluster(prefill=2, decode=2, speed=0.0)


@pytest.fixture
def slow_cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=1, speed=1.0)


def metric(router, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the router's own Prometheus registry (0 when absent)."""
    value = router.state.metrics.registry.get_sample_value(name, labels or {})
    return value or 0.0


def retries(router) -> float:
    return metric(router, "pd_router_retries_total")


async def test_prefill_503_is_retried_on_a_new_pair(cluster):
    for url in cluster.prefill_urls:
        await fault(url, fail_next=1, fail_status=503)
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("retry me", TOKENS))
        assert response.status_code == 200
        assert_paired(response.json(), "retry me", TOKENS)
        assert retries(router) == 2


async def test_decode_503_before_first_byte_is_retried(cluster):
    for url in cluster.decode_urls:
        await fault(url, fail_next=1, fail_status=503)
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("decode retry", TOKENS))
        assert response.status_code == 200
        assert_paired(response.json(), "decode retry", TOKENS)


async def test_stream_is_retried_when_prefill_fails_before_first_byte(cluster):
    for url in cluster.prefill_urls:
        await fault(url, fail_next=1, fail_status=502)
    async with running_router(cluster) as router, router.client() as http:
        body = generate_body("stream retry", TOKENS, stream=True)
        events = sse_events((await http.post("/generate", json=body)).text)
        assert events[-1] == "[DONE]"
        assert events[-2]["text"] == expected_text("stream retry", TOKENS)


async def test_prefill_500_fails_fast_and_leaves_no_decode_waiting(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    await fault(prefill, fail_next=3, fail_status=500)  # every attempt (a prefill 5xx is retried)
    async with (
        running_router(cluster, prefill=[prefill], decode=[decode]) as router,
        router.client() as http,
    ):
        started = time.monotonic()
        response = await http.post("/generate", json=generate_body("fails", TOKENS))
        assert time.monotonic() - started < 5.0  # not the decode's 30 s bootstrap timeout
        assert response.status_code == 502
        assert prefill in response.json()["error"]["message"]
        assert retries(router) == 2
        await wait_until(lambda: worker_idle(decode), 5.0, "decode idle")


async def test_prefill_500_is_retried_on_a_new_pair(cluster):
    for url in cluster.prefill_urls:
        await fault(url, fail_next=1, fail_status=500)
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("retry 500", TOKENS))
        assert response.status_code == 200
        assert_paired(response.json(), "retry 500", TOKENS)


async def test_frozen_prefill_times_out_and_the_waiting_decode_is_cancelled(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=1, speed=0.0)
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    frozen = cluster.worker(prefill).process
    async with running_router(
        cluster, request_timeout_secs=1.0, health={"interval_secs": 30.0}
    ) as router:
        frozen.send_signal(signal.SIGSTOP)
        try:
            async with router.client() as http:
                response = await http.post("/generate", json=generate_body("frozen", TOKENS))
            assert response.status_code == 504
            # The decode waits for a bootstrap that never answers (its own timeout is 30 s):
            # only the router's cancellation frees it.
            await wait_until(lambda: worker_idle(decode), 5.0, "decode freed")
            assert await worker_metric(decode, "num_aborted_requests_total") >= 1
        finally:
            frozen.send_signal(signal.SIGCONT)


async def _aborted_more(url: str, before: float) -> bool:
    return await worker_metric(url, "num_aborted_requests_total") > before


async def test_decode_500_cancels_the_prefill(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    await fault(decode, fail_next=1, fail_status=500)
    await fault(prefill, delay_secs=0.3)
    async with (
        running_router(cluster, prefill=[prefill], decode=[decode]) as router,
        router.client() as http,
    ):
        response = await http.post("/generate", json=generate_body("decode fails", TOKENS))
        assert response.status_code == 502
        await wait_until(lambda: worker_idle(prefill), 5.0, "prefill leg cancelled")


async def test_worker_4xx_is_passed_through_without_retry(cluster):
    for url in cluster.prefill_urls:
        await fault(url, fail_next=1, fail_status=400)
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("bad", TOKENS))
        assert response.status_code == 400
        assert retries(router) == 0


async def test_all_prefills_draining_gives_503_with_retry_after(cluster):
    for url in cluster.prefill_urls:
        await fault(url, fail_next=10, fail_status=503)
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("nowhere", TOKENS))
        assert response.status_code == 503
        assert response.headers["Retry-After"]
        assert response.json()["error"]["type"] == "upstream_unavailable"
        assert retries(router) == router.state.config.retry.max_attempts - 1


async def test_upstream_timeout_gives_504(cluster):
    await fault(cluster.decode_urls[0], delay_secs=2.0)
    async with (
        running_router(
            cluster, decode=[cluster.decode_urls[0]], request_timeout_secs=0.5
        ) as router,
        router.client() as http,
    ):
        response = await http.post("/generate", json=generate_body("slow", TOKENS))
        assert response.status_code == 504
        assert response.json()["error"]["type"] == "upstream_timeout"


async def test_no_healthy_decode_gives_503_with_retry_after(cluster, free_port):
    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        running_router(cluster, decode=[dead]) as router,
        router.client() as http,
    ):
        response = await http.post("/generate", json=generate_body("x", TOKENS))
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert response.json()["error"]["type"] == "no_available_workers"


async def test_killed_prefill_is_skipped_and_taken_out_of_its_pool(cluster_factory):
    """A refused connection is proof enough: the first leg that cannot connect has the worker
    read at once and out of its pool, before its circuit would count to its threshold."""
    cluster = cluster_factory(prefill=2, decode=1, speed=0.0)
    dead = cluster.prefill_urls[0]
    async with (
        running_router(
            cluster,
            health={"interval_secs": 60.0},
            circuit={"failure_threshold": 2, "cooldown_secs": 60.0},
            prefill_policy="round_robin",  # the dead prefill is picked often enough, every run
        ) as router,
        router.client() as http,
    ):
        cluster.kill(dead)
        for i in range(8):
            response = await http.post("/generate", json=generate_body(f"survive {i}", TOKENS))
            assert response.status_code == 200
            assert assert_paired(response.json(), f"survive {i}", TOKENS) != dead
        worker = router.state.registry.get(dead)
        assert not worker.healthy
        assert not worker.selectable


async def test_decode_killed_mid_stream_ends_with_an_sse_error_event(slow_cluster):
    decode = slow_cluster.decode_urls[0]
    async with running_router(slow_cluster) as router, router.client() as http:
        body = generate_body("doomed stream", SLOW_TOKENS, stream=True)
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data:")
            slow_cluster.kill(decode)
            rest = [line async for line in lines]
        events = sse_events("\n\n".join([first, *rest]))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "upstream_error"
        assert decode in events[-2]["error"]["message"]
        labels = {"role": "decode", "kind": "disconnect"}
        assert metric(router, "pd_router_upstream_errors_total", labels) == 1


async def test_client_leaving_a_stream_aborts_both_legs(slow_cluster):
    prefill, decode = slow_cluster.prefill_urls[0], slow_cluster.decode_urls[0]
    async with running_router(slow_cluster) as router:
        async with router.client() as http:
            body = generate_body("abandoned", SLOW_TOKENS, stream=True)
            async with http.stream("POST", "/generate", json=body) as response:
                await anext(response.aiter_lines())
        await wait_until(lambda: _aborted_more(decode, 0), 5.0, "decode got /abort_request")
        await settled(router, decode, prefill)


async def test_client_leaving_a_unary_request_aborts_both_legs(slow_cluster):
    decode = slow_cluster.decode_urls[0]
    async with running_router(slow_cluster) as router:
        async with router.client() as http:
            request = asyncio.create_task(
                http.post("/generate", json=generate_body("gone", SLOW_TOKENS))
            )
            await wait_until(lambda: _busy(decode), 5.0, "decode started")
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        await wait_until(lambda: _aborted_more(decode, 0), 5.0, "decode got /abort_request")
        await settled(router, decode)
        labels = {"endpoint": "/generate", "status": "499"}
        assert metric(router, "pd_router_requests_total", labels) == 1


async def _busy(url: str) -> bool:
    return not await worker_idle(url)


async def test_router_serves_again_after_failures(cluster):
    await fault(cluster.prefill_urls[0], fail_next=3, fail_status=503)
    async with running_router(cluster) as router, router.client() as http:
        results = await asyncio.gather(
            *(http.post("/generate", json=generate_body(f"mix {i}", TOKENS)) for i in range(10))
        )
        assert [r.status_code for r in results] == [200] * 10


async def test_retry_with_no_worker_left_reports_the_real_failure(cluster):
    prefill = cluster.prefill_urls[0]
    await fault(prefill, fail_next=10, fail_status=502)
    async with (
        running_router(
            cluster,
            prefill=[prefill],
            health={"interval_secs": 30.0},
            circuit={"failure_threshold": 1, "cooldown_secs": 30.0},
        ) as router,
        router.client() as http,
    ):
        response = await http.post("/generate", json=generate_body("alone", TOKENS))
        assert response.status_code == 502
        assert prefill in response.json()["error"]["message"]


async def test_stream_whose_first_event_is_a_failed_kv_handoff_is_retried(cluster_factory):
    cluster = cluster_factory(prefill=2, decode=1, speed=0.0, bootstrap_timeout_secs=1.0)
    broken, good = cluster.prefill_urls
    # The first prefill's bootstrap server never answers: the decode's KV pull times out and
    # its stream opens with an abort event carrying a 500.
    await fault(broken, hang_bootstrap=True)
    async with (
        running_router(cluster, prefill=[broken, good], prefill_policy="round_robin") as router,
        router.client() as http,
    ):
        body = generate_body("handoff failed first", TOKENS, stream=True)
        events = sse_events((await http.post("/generate", json=body)).text)
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == expected_text("handoff failed first", TOKENS)
    retries = router.state.metrics.registry.get_sample_value("pd_router_retries_total")
    assert retries == 1


async def test_a_decode_500_for_a_failed_kv_transfer_is_retried(cluster):
    """SGLang's decode answers 500 "Decode transfer failed ..." when its KV hand-off failed or was
    aborted (a decode told to forget a prefill's stale endpoints fails the requests stuck on
    them): nothing was generated, so the request is retried on another pair."""
    decode = cluster.decode_urls[0]
    message = (
        "Decode transfer failed for request rank=0 decode_req.req.rid='r-0' with exception "
        "KVTransferError(bootstrap_room=1): Aborted by AbortReq."
    )
    await fault(decode, fail_next=1, fail_status=500, fail_message=message)
    async with running_router(cluster, decode_policy="round_robin") as router:
        async with router.client() as http:
            for _ in range(2):
                response = await http.post("/generate", json=generate_body("retried", TOKENS))
                assert response.status_code == 200, response.text
        assert retries(router) == 1
