"""Admission of generation requests by number and rate (``[admission]``), through a real router
and reference workers whose decode steps are slow enough to keep a request in flight: the
concurrency limit and its FIFO queue, the 429s of a full queue, of a queue timeout and of an
empty token bucket, a client leaving the queue, and the metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_router.config import ConfigError, load_config
from tests.router_helpers import generate_body, running_router, wait_until

# 50 ms decode steps: an answer of LONG tokens stays in flight about 3 s, one of SHORT about
# 0.1 s (plus the prefill).
TIMING = {"speed": 1.0, "decode_step_base_secs": 0.05}
LONG = 60
SHORT = 2


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, **TIMING)


def limits(**admission: object) -> dict[str, object]:
    return {"admission": admission}


def assert_refused(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 429
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert (error["type"], error["code"], error["reason"]) == ("rate_limit_exceeded", 429, reason)


def metric(text: str, line_start: str) -> float:
    return next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)
    )


async def test_requests_beyond_the_limit_wait_and_are_served_in_arrival_order(cluster):
    async with running_router(cluster, **limits(max_concurrent_requests=1)) as router:
        admission = router.dataplane.path.admission
        finished: list[str] = []
        async with router.client() as http:

            async def send(name: str, tokens: int) -> int:
                response = await http.post("/generate", json=generate_body(name, tokens))
                finished.append(name)
                return response.status_code

            first = asyncio.create_task(send("first", LONG))
            await wait_until(lambda: admission.active == 1, 5.0, what="first request admitted")
            second = asyncio.create_task(send("second", SHORT))
            await wait_until(lambda: admission.queued == 1, 5.0, what="second request queued")
            third = asyncio.create_task(send("third", SHORT))
            await wait_until(lambda: admission.queued == 2, 5.0, what="third request queued")
            assert admission.active == 1
            assert await asyncio.gather(first, second, third) == [200, 200, 200]
        assert finished == ["first", "second", "third"]
        assert (admission.active, admission.queued) == (0, 0)


async def test_a_stream_holds_its_slot_until_it_ended(cluster):
    async with running_router(cluster, **limits(max_concurrent_requests=1)) as router:
        admission = router.dataplane.path.admission
        async with router.client() as http:
            body = generate_body("streamed", LONG, stream=True)
            async with http.stream("POST", "/generate", json=body) as stream:
                pieces = stream.aiter_bytes()
                await anext(pieces)
                waiting = asyncio.create_task(
                    http.post("/generate", json=generate_body("after", SHORT))
                )
                await wait_until(lambda: admission.queued == 1, 5.0, what="request queued")
                assert not waiting.done()
                async for _ in pieces:
                    pass
            assert (await waiting).status_code == 200


async def test_a_full_queue_answers_429_with_retry_after_at_once(cluster):
    async with running_router(cluster, **limits(max_concurrent_requests=1, queue_size=1)) as router:
        admission = router.dataplane.path.admission
        async with router.client() as http:
            running = asyncio.create_task(http.post("/generate", json=generate_body("a", LONG)))
            await wait_until(lambda: admission.active == 1, 5.0, what="first request admitted")
            queued = asyncio.create_task(http.post("/generate", json=generate_body("b", SHORT)))
            await wait_until(lambda: admission.queued == 1, 5.0, what="second request queued")
            refused = await http.post("/generate", json=generate_body("c", SHORT))
            assert not running.done()
            assert_refused(refused, "queue_full")
            assert [r.status_code for r in await asyncio.gather(running, queued)] == [200, 200]
            text = (await http.get("/metrics")).text
        assert metric(text, 'pd_router_admission_rejections_total{reason="queue_full"}') == 1
        assert metric(text, 'pd_router_requests_total{endpoint="/generate",status="429"}') == 1


async def test_a_request_waiting_longer_than_the_queue_timeout_gets_429(cluster):
    config = limits(max_concurrent_requests=1, queue_timeout_secs=0.3)
    async with running_router(cluster, **config) as router:
        admission = router.dataplane.path.admission
        async with router.client() as http:
            running = asyncio.create_task(http.post("/generate", json=generate_body("a", LONG)))
            await wait_until(lambda: admission.active == 1, 5.0, what="first request admitted")
            refused = await http.post("/generate", json=generate_body("b", SHORT))
            assert not running.done()
            assert_refused(refused, "queue_timeout")
            assert admission.queued == 0
            assert (await running).status_code == 200


async def test_a_client_that_leaves_while_queued_leaves_the_queue(cluster):
    async with running_router(cluster, **limits(max_concurrent_requests=1)) as router:
        admission = router.dataplane.path.admission
        async with router.client() as http:
            running = asyncio.create_task(http.post("/generate", json=generate_body("a", LONG)))
            await wait_until(lambda: admission.active == 1, 5.0, what="first request admitted")
            async with router.client() as impatient:
                leaving = asyncio.create_task(
                    impatient.post("/generate", json=generate_body("b", SHORT))
                )
                await wait_until(lambda: admission.queued == 1, 5.0, what="request queued")
                leaving.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leaving
            await wait_until(lambda: admission.queued == 0, 5.0, what="queue emptied")
            assert (await running).status_code == 200
            after = await http.post("/generate", json=generate_body("c", SHORT))
            assert after.status_code == 200
        assert (admission.active, admission.queued) == (0, 0)


async def test_an_empty_token_bucket_answers_429_until_it_refills(cluster):
    async with running_router(cluster, **limits(rate_limit_tokens_per_second=2.0)) as router:
        async with router.client() as http:
            assert (await http.post("/generate", json=generate_body("a", 1))).status_code == 200
            refused = await http.post("/generate", json=generate_body("b", 1))
            if refused.status_code == 200:
                pytest.skip("the machine took over half a second between two requests")
            assert_refused(refused, "rate_limited")

            async def served() -> bool:
                response = await http.post("/generate", json=generate_body("c", 1))
                return response.status_code == 200

            await wait_until(served, 5.0, what="a token refilled")
            text = (await http.get("/metrics")).text
        assert metric(text, 'pd_router_admission_rejections_total{reason="rate_limited"}') >= 1


async def test_probes_and_metrics_are_not_limited(cluster):
    config = limits(max_concurrent_requests=1, queue_size=0)
    async with running_router(cluster, **config) as router:
        admission = router.dataplane.path.admission
        async with router.client() as http:
            running = asyncio.create_task(http.post("/generate", json=generate_body("a", LONG)))
            await wait_until(lambda: admission.active == 1, 5.0, what="first request admitted")
            assert_refused(await http.post("/generate", json=generate_body("b", 1)), "queue_full")
            for path in ("/health", "/readiness", "/metrics", "/v1/models"):
                assert (await http.get(path)).status_code == 200, path
            assert (await running).status_code == 200


async def test_admission_series_exist_before_any_request(cluster):
    async with running_router(cluster) as router, router.client() as http:
        text = (await http.get("/metrics")).text
    assert metric(text, "pd_router_admission_queue_depth ") == 0
    for reason in ("queue_full", "queue_timeout", "rate_limited"):
        assert metric(text, f'pd_router_admission_rejections_total{{reason="{reason}"}}') == 0


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (limits(max_concurrent_requests=-1), "admission.max_concurrent_requests"),
        (limits(queue_size=-1), "admission.queue_size"),
        (limits(queue_timeout_secs=0), "admission.queue_timeout_secs"),
        (limits(rate_limit_tokens_per_second=-1.0), "admission.rate_limit_tokens_per_second"),
        (limits(queue_limit=5), "admission.queue_limit"),
    ],
)
def test_invalid_admission_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as caught:
        load_config(None, data)
    assert caught.value.key == key
