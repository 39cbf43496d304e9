"""A pair whose prefill and decode never meet (SGLang 0.5.23's decode that kept a round-tripped
prefill's old KV endpoint: issue 27, bug b), reproduced with the reference worker's
``stale_bootstrap`` fault: the decode's pulls from the first prefill never arrive, and both legs
would hang until the workers' own 30 s bootstrap timeout. The router bounds the wait, aborts both
legs, answers from another pair, keeps that pair apart until the prefill changes, and lets a
conversion's drain end at the wait."""

from __future__ import annotations

import asyncio
import time

import pytest

from pd_worker.cluster import WorkerCluster
from tests.conversion_helpers import convert, worker_entry
from tests.router_helpers import (
    assert_paired,
    fault,
    generate_body,
    running_router,
    sse_events,
    wait_until,
    worker_metric,
)
from tests.router_process import router_process

WAIT = 1.5  # the rendezvous wait under test; the workers' own bootstrap timeout is 30 s
SLACK = 2.0  # a retry on a healthy pair, the 0.2 s ticker, a loaded 2-core machine
TOKENS = 4
PAIRS = {
    "legs": {"rendezvous_timeout_secs": WAIT, "rendezvous_cooldown_secs": 60.0},
    "prefill_policy": "round_robin",  # the first attempt goes to the first worker listed
    "decode_policy": "round_robin",
}


@pytest.fixture(scope="module")
def cluster(module_cluster_factory) -> WorkerCluster:
    return module_cluster_factory(prefill=2, decode=2, speed=1.0)


@pytest.fixture
async def stuck_pair(cluster):
    """(prefill, decode): the cluster's first prefill and first decode, which never meet. The
    decode runs without server_patch (``native_only``), so nothing makes it forget."""
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    stale = f"127.0.0.1:{cluster.bootstrap_port(prefill)}"
    await fault(decode, stale_bootstrap=stale, native_only=True)
    yield prefill, decode
    await fault(decode, clear=True)


def rendezvous_misses(router) -> float:
    registry = router.state.metrics.registry
    return sum(
        registry.get_sample_value(
            "pd_router_upstream_errors_total", {"role": role, "kind": "rendezvous"}
        )
        or 0.0
        for role in ("prefill", "decode")
    )


async def aborted(url: str) -> float:
    return await worker_metric(url, "num_aborted_requests_total")


async def timed_generate(http, prompt: str, **extra) -> tuple[float, object]:
    started = time.monotonic()
    response = await http.post("/generate", json=generate_body(prompt, TOKENS, **extra))
    return time.monotonic() - started, response


async def test_a_request_through_a_stuck_pair_is_answered_by_another_after_the_wait(
    cluster, stuck_pair
):
    prefill, decode = stuck_pair
    before = {url: await aborted(url) for url in stuck_pair}
    async with running_router(cluster, **PAIRS) as router, router.client() as http:
        elapsed, response = await timed_generate(http, "stuck once")
        assert response.status_code == 200, response.text
        assert_paired(response.json(), "stuck once", TOKENS)
        assert WAIT <= elapsed < WAIT + SLACK
        assert rendezvous_misses(router) >= 1
    for url in (prefill, decode):
        await wait_until(
            lambda url=url: _above(url, before[url]), what=f"{url} told to abort both legs"
        )


async def _above(url: str, before: float) -> bool:
    return await aborted(url) > before


async def test_a_stuck_pair_is_not_picked_again_while_its_workers_serve_other_pairs(
    cluster, stuck_pair
):
    prefill, decode = stuck_pair
    other_prefill = cluster.prefill_urls[1]
    # Random decodes: round robin on both pools would pair them in lockstep.
    spread = {**PAIRS, "decode_policy": "random"}
    async with running_router(cluster, **spread) as router, router.client() as http:
        while not rendezvous_misses(router):
            await timed_generate(http, "until the pair was tried")
        misses = rendezvous_misses(router)
        served = await worker_metric(decode, "num_requests_total")
        sources = set()
        for n in range(20):
            elapsed, response = await timed_generate(http, f"after {n}")
            assert response.status_code == 200, response.text
            assert elapsed < WAIT
            sources.add(response.json()["meta_info"]["kv_source"])
        assert rendezvous_misses(router) == misses
        # Both workers of the stuck pair kept serving, their circuits closed: the prefill with
        # the other decode, the decode with the other prefill.
        assert sources == {prefill, other_prefill}
        assert await worker_metric(decode, "num_requests_total") > served
        for url in stuck_pair:
            assert (await worker_entry(http, url))["circuit"] == "closed"


async def test_a_prefill_whose_only_decode_is_stuck_with_it_gives_way_to_another(
    cluster, stuck_pair
):
    prefill, decode = stuck_pair
    other_prefill = cluster.prefill_urls[1]
    async with (
        running_router(cluster, decode=[decode], **PAIRS) as router,
        router.client() as http,
    ):
        await timed_generate(http, "first")
        assert rendezvous_misses(router) == 1
        for n in range(6):
            elapsed, response = await timed_generate(http, f"only {n}")
            assert response.status_code == 200, response.text
            assert elapsed < WAIT
            assert response.json()["meta_info"]["kv_source"] == other_prefill
        assert (await worker_entry(http, prefill))["circuit"] == "closed"


async def test_a_stuck_pair_is_picked_again_once_its_prefill_changed_role_and_back(
    cluster, stuck_pair
):
    prefill, _ = stuck_pair
    async with running_router(cluster, **PAIRS) as router, router.client() as http:
        await timed_generate(http, "first")
        misses = rendezvous_misses(router)
        epoch = (await worker_entry(http, prefill))["epoch"]
        for role in ("decode", "prefill"):
            reply = await convert(http, server_url=prefill, new_role=role)
            assert reply.status_code == 200, reply.text
        assert (await worker_entry(http, prefill))["epoch"] == epoch + 2
        # The decode still never reaches that prefill: the pair, tried again, misses again.
        for n in range(6):
            _, response = await timed_generate(http, f"again {n}")
            assert response.status_code == 200, response.text
            if rendezvous_misses(router) > misses:
                break
        assert rendezvous_misses(router) > misses


async def test_a_stream_through_a_stuck_pair_is_answered_by_another(cluster, stuck_pair):
    async with running_router(cluster, **PAIRS) as router, router.client() as http:
        elapsed, response = await timed_generate(http, "stream", stream=True)
        assert response.status_code == 200, response.text
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        assert all("error" not in event for event in events[:-1])
        assert WAIT <= elapsed < WAIT + SLACK
        assert rendezvous_misses(router) >= 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_stuck_pair_on_the_last_attempt_answers_504(cluster, stuck_pair, stream):
    single = {**PAIRS, "retry": {"max_attempts": 1}}
    async with running_router(cluster, **single) as router, router.client() as http:
        elapsed, response = await timed_generate(http, "no retry", stream=stream)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "upstream_timeout"
        assert "rendezvous" in response.json()["error"]["message"]
        assert WAIT <= elapsed < WAIT + SLACK


async def test_converting_the_stuck_decode_drains_within_the_wait(cluster, stuck_pair):
    _, decode = stuck_pair
    async with running_router(cluster, **PAIRS) as router, router.client() as http:
        stuck = asyncio.create_task(timed_generate(http, "held by the pair"))
        await wait_until(lambda: router.state.registry.get(decode).inflight > 0)
        started = time.monotonic()
        reply = await convert(http, server_url=decode, new_role="prefill")
        converted_after = time.monotonic() - started
        assert reply.status_code == 200, reply.text
        assert converted_after < WAIT + SLACK
        _, response = await stuck
        assert response.status_code == 200, response.text
        back = await convert(http, server_url=decode, new_role="decode")
        assert back.status_code == 200, back.text


async def test_each_data_plane_waits_for_a_stuck_pair_once_at_most(cluster, stuck_pair):
    processes = {**PAIRS, "server": {"workers": 2}}
    slow = 0
    async with router_process(
        prefill=cluster.prefill_urls, decode=cluster.decode_urls, **processes
    ) as router:
        for n in range(10):
            # A connection per request: the kernel spreads them over the data planes.
            async with router.client(headers={"Connection": "close"}) as http:
                elapsed, response = await timed_generate(http, f"plane {n}")
            assert response.status_code == 200, response.text
            assert elapsed < WAIT + SLACK
            slow += elapsed >= WAIT
    assert 1 <= slow <= 2
