"""One router, two models, on real processes: ``big`` served in PD (a prefill and two decodes)
and ``small`` by two regular workers (``--disaggregation-mode null``). The router reads each
worker's model from its ``/server_info`` (nothing in its configuration names one) and routes
each request by its ``model``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from pd_worker.cluster import WorkerCluster
from tests.cli_process import serving
from tests.open_load import OpenLoad
from tests.router_helpers import (
    assert_paired,
    generate_body,
    running_router,
    sse_events,
    wait_until,
    worker_metric,
)
from tests.router_process import router_process
from tests.test_autopilot_flow import AUTOPILOT as FAST_AUTOPILOT
from tests.test_autopilot_flow import TIMING as PROMPT_HEAVY_TIMING

BIG = "big"
SMALL = "small"


@pytest.fixture(scope="module")
def big() -> Iterator[WorkerCluster]:
    with WorkerCluster(prefill=1, decode=2, extra_args=("--served-model-name", BIG)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def small() -> Iterator[WorkerCluster]:
    with WorkerCluster(
        prefill=0, decode=0, regular=2, extra_args=("--served-model-name", SMALL)
    ) as cluster:
        yield cluster


def both(big: WorkerCluster, small: WorkerCluster, **overrides):
    regular = [{"url": url} for url in small.regular_urls]
    return running_router(big, regular=regular, **overrides)


def chat(model: str, text: str = "hello", **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **extra,
    }


async def requests_on(urls: list[str]) -> float:
    return sum([await worker_metric(url, "num_requests_total") for url in urls])


async def test_a_request_naming_the_pd_model_goes_to_its_prefill_and_a_decode(big, small):
    async with both(big, small) as router, router.client() as http:
        answer = await http.post("/generate", json=generate_body("to big", 4, model=BIG))
    assert answer.status_code == 200, answer.text
    assert assert_paired(answer.json(), "to big", 4) in big.prefill_urls[0]


async def test_a_request_naming_the_regular_model_is_served_whole_by_one_regular_worker(big, small):
    before_small = await requests_on(small.regular_urls)
    before_big = await requests_on(big.urls)
    async with both(big, small) as router, router.client() as http:
        answer = await http.post("/v1/chat/completions", json=chat(SMALL))
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == SMALL
    assert await requests_on(small.regular_urls) == before_small + 1
    assert await requests_on(big.urls) == before_big


async def test_a_stream_from_a_regular_worker_is_relayed_to_its_end(big, small):
    async with both(big, small) as router, router.client() as http:
        answer = await http.post("/v1/chat/completions", json=chat(SMALL, stream=True))
    assert answer.status_code == 200, answer.text
    events = sse_events(answer.text)
    assert events[-1] == "[DONE]"
    assert all(event["model"] == SMALL for event in events[:-1])


async def test_a_model_no_worker_serves_gets_404_model_not_found(big, small):
    async with both(big, small) as router, router.client() as http:
        answer = await http.post("/v1/chat/completions", json=chat("medium"))
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "model_not_found"


async def test_a_request_naming_no_model_gets_400_while_several_are_served(big, small):
    async with both(big, small) as router, router.client() as http:
        answer = await http.post("/generate", json=generate_body("which model?", 4))
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "model_required"


async def test_v1_models_lists_every_model_served(big, small):
    async with both(big, small) as router, router.client() as http:
        listing = (await http.get("/v1/models")).json()
        one = await http.get(f"/v1/models/{SMALL}")
    assert sorted(model["id"] for model in listing["data"]) == [BIG, SMALL]
    assert one.json()["id"] == SMALL


async def test_the_workers_list_shows_the_model_each_worker_serves(big, small):
    async with both(big, small) as router, router.client() as http:
        workers = (await http.get("/workers")).json()["workers"]
    models = {w["url"]: (w["model"], w["role"]) for w in workers}
    assert models == {
        **{url: (BIG, "prefill") for url in big.prefill_urls},
        **{url: (BIG, "decode") for url in big.decode_urls},
        **{url: (SMALL, "regular") for url in small.regular_urls},
    }


async def test_a_regular_worker_is_refused_a_conversion_with_409(big, small):
    async with both(big, small) as router, router.client() as http:
        answer = await http.post("/convert_pd_role", json={"server_url": small.regular_urls[0]})
    assert answer.status_code == 409
    assert answer.json()["error"]["reason"] == "not_convertible"


async def test_a_conversion_in_the_pd_model_under_load_fails_no_request_of_either(big, small):
    decode = big.decode_urls[1]
    failures: list[str] = []
    stop = asyncio.Event()

    async def load(http: httpx.AsyncClient, body_of) -> int:
        sent = 0
        while not stop.is_set():
            path, body = body_of(sent)
            answer = await http.post(path, json=body)
            sent += 1
            if answer.status_code != 200:
                failures.append(f"{answer.status_code} {answer.text[:200]}")
        return sent

    def to_big(i: int):
        return "/generate", generate_body(f"big {i}", 4, model=BIG)

    def to_small(i: int):
        return "/v1/chat/completions", chat(SMALL, f"small {i}")

    async with both(big, small) as router, router.client() as http:
        loads = [asyncio.create_task(load(http, body)) for body in (to_big, to_small) * 2]
        converted = await http.post(
            "/convert_pd_role", json={"server_url": decode, "new_role": "prefill"}
        )
        await wait_until(lambda: router_prefills(router) == 2, 30.0, "the decode converted")
        await asyncio.sleep(0.5)
        stop.set()
        sent = await asyncio.gather(*loads)
        back = await http.post("/convert_pd_role", json={"server_url": decode})
        await wait_until(lambda: router_prefills(router) == 1, 30.0, "the worker back")
    assert converted.status_code == 200, converted.text
    assert back.status_code == 200, back.text
    assert failures == []
    assert all(n > 0 for n in sent)


def router_prefills(router) -> int:
    return sum(
        1
        for w in router.state.registry
        if w.role.value == "prefill" and w.model == BIG and w.state.value == "active"
    )


async def test_a_regular_worker_that_dies_has_its_requests_served_by_the_other(big, small):
    extra = WorkerCluster(
        prefill=0, decode=0, regular=1, extra_args=("--served-model-name", SMALL)
    ).start()
    try:
        regular = [{"url": url} for url in [*small.regular_urls, *extra.regular_urls]]
        async with running_router(big, regular=regular) as router, router.client() as http:
            await wait_until(
                lambda: all(w.healthy for w in router.state.registry), 10.0, "all healthy"
            )
            extra.kill(extra.regular_urls[0])
            answers = [
                await http.post("/v1/chat/completions", json=chat(SMALL, f"after {i}"))
                for i in range(6)
            ]
    finally:
        extra.stop()
    assert [a.status_code for a in answers] == [200] * 6


def test_pd_router_with_worker_urls_alone_serves_as_a_regular_router(small):
    """sglang-router's regular mode: ``--worker-urls A B``, no prefill and no decode; the one
    model's requests need no ``model`` and go to the workers whole, without a warning about
    the flag."""
    with serving("--host", "127.0.0.1", "--worker-urls", *small.regular_urls) as router:
        wait_ready(router.url)
        answers = [
            httpx.post(router.url + "/generate", json=generate_body(f"plain {i}", 4), timeout=30)
            for i in range(4)
        ]
        chat_answer = httpx.post(
            router.url + "/v1/chat/completions", json=chat("anything"), timeout=30
        )
        log = router.log()
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json()["text"] for a in answers)
    assert chat_answer.status_code == 200, chat_answer.text
    assert "--worker-urls is accepted" not in log


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 15.0
    while httpx.get(url + "/readiness", timeout=2.0).status_code != 200:
        assert time.monotonic() < deadline, "router not ready"
        time.sleep(0.05)


async def test_the_autopilot_converts_within_the_model_whose_traffic_needs_it(cluster_factory):
    """Two PD models of one prefill and two decodes each; prompt-heavy traffic to ``a`` only
    (as tests/test_autopilot_flow.py's, which leaves one prefill short by half):
    a decode of ``a`` becomes a prefill, ``b``'s pools stay as they were, and ``/autopilot``
    tells each model's decisions apart."""
    a, b = (
        cluster_factory(prefill=1, decode=2, extra_args=served(name), **PROMPT_HEAVY_TIMING)
        for name in "ab"
    )
    prefill = [*a.prefill_urls, *b.prefill_urls]
    decode = [*a.decode_urls, *b.decode_urls]
    async with (
        running_router(prefill=prefill, decode=decode, autopilot=FAST_AUTOPILOT) as router,
        router.client() as http,
    ):
        async with OpenLoad(router.url, 14.0, 8, model="a") as load:
            await wait_until(lambda: prefills_of(router, "a") == 2, 20.0, "a decode of a converted")
            await asyncio.sleep(1.0)
        state = (await http.get("/autopilot")).json()
    assert load.failed == []
    assert prefills_of(router, "b") == 1
    converted = [d for d in state["models"]["a"]["decisions"] if d["action"] != "hold"]
    assert [(d["action"], d["worker"] in a.decode_urls) for d in converted] == [
        ("decode_to_prefill", True)
    ]
    assert state["models"]["b"]["decisions"] == []


def served(model: str) -> tuple[str, ...]:
    return ("--served-model-name", model)


def prefills_of(router, model: str) -> int:
    return sum(
        1
        for w in router.state.registry
        if w.role.value == "prefill" and w.model == model and w.state.value == "active"
    )


async def test_a_traced_request_to_a_regular_worker_has_its_leg_span_and_traceparent(big, small):
    otlp = pytest.importorskip("tests.otlp_receiver", reason="needs the otel extra (make install)")
    async with otlp.otlp_receiver() as receiver:
        tracing = {"enabled": True, "endpoint": receiver.endpoint}
        regular = [{"url": url} for url in small.regular_urls]
        async with (
            router_process(
                prefill=big.prefill_urls,
                decode=big.decode_urls,
                regular=regular,
                tracing=tracing,
            ) as router,
            router.client() as http,
        ):
            answer = await http.post("/v1/chat/completions", json=chat(SMALL, "traced"))
            assert answer.status_code == 200, answer.text
            spans = await receiver.wait_for(lambda spans: len(spans) >= 2)
    (request,) = [s for s in spans if s.kind == "server"]
    (leg,) = [s for s in spans if s.parent_id == request.span_id]
    assert request.attributes["gen_ai.request.model"] == SMALL
    assert (leg.name, leg.attributes["pd.leg.outcome"]) == ("regular leg", "ok")
    worker = leg.attributes["url.full"].removesuffix("/v1/chat/completions")
    assert worker in small.regular_urls
    async with httpx.AsyncClient(timeout=5.0) as plain:
        received = (await plain.get(worker + "/trace_headers")).json()["requests"]
    assert ("00", request.trace_id, leg.span_id) in {
        tuple(e["traceparent"].split("-")[:3]) for e in received if "traceparent" in e
    }


async def test_a_worker_not_read_yet_makes_no_model_of_its_own(big, free_port):
    """An unreachable decode's model is never read: the router still serves one model,
    ready, a request naming none routed as before."""
    nobody = f"http://127.0.0.1:{free_port()}"
    decode = [*big.decode_urls, nobody]
    async with running_router(big, decode=decode) as router, router.client() as http:
        readiness = await http.get("/readiness")
        answer = await http.post("/generate", json=generate_body("no model named", 4))
    assert readiness.status_code == 200, readiness.text
    assert "models" not in readiness.json()
    assert answer.status_code == 200, answer.text
