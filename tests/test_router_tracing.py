"""OpenTelemetry traces (``[tracing]``, ``--enable-trace``), against a real OTLP/HTTP receiver
(tests/otlp_receiver.py), real router processes and reference workers: a request is one trace
with its span and a span per leg (per attempt), each worker gets its leg's ``traceparent``, a
client's ``traceparent`` is continued, each data-plane process of ``--workers 2`` exports its
own spans, a conversion is a span with its phases; with tracing off nothing is exported or
propagated, and OpenTelemetry is not even imported."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

pytest.importorskip(
    "opentelemetry.sdk", reason="needs the otel extra: pip install -e '.[otel]' (make install)"
)

from tests.conversion_helpers import convert
from tests.fault_cluster import clear_faults, module_cluster  # noqa: F401 (fixtures)
from tests.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.router_helpers import fault, generate_body
from tests.router_process import router_process

# Three of the exporter's 0.5 s batch periods: what a router with tracing on would have sent.
EXPORT_WAIT_SECS = 1.5
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
CLOSE = {"Connection": "close"}


cluster = module_cluster(prefill=1, decode=1, speed=0.0)


@pytest.fixture
async def receiver():
    async with otlp_receiver() as receiver:
        yield receiver


@contextlib.asynccontextmanager
async def traced_router(
    cluster, receiver, enabled: bool = True, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a router process over ``cluster`` exporting to ``receiver`` (``enabled``:
    tracing on)."""
    tracing = {"enabled": enabled, "endpoint": receiver.endpoint}
    async with (
        router_process(
            prefill=cluster.prefill_urls,
            decode=cluster.decode_urls,
            tracing=tracing,
            **overrides,
        ) as router,
        router.client() as http,
    ):
        yield http


def request_span(spans: list[ReceivedSpan]) -> ReceivedSpan | None:
    return next((s for s in spans if s.kind == "server"), None)


def legs_of(spans: list[ReceivedSpan], request: ReceivedSpan) -> list[ReceivedSpan]:
    """The leg spans under ``request``, in the order of their attempts (prefill first)."""
    legs = [s for s in spans if s.parent_id == request.span_id]
    return sorted(
        legs, key=lambda s: (s.attributes["pd.attempt"], s.attributes["pd.role"] != "prefill")
    )


async def traced_request(receiver, legs: int = 2) -> tuple[ReceivedSpan, list[ReceivedSpan]]:
    """The one request span received and its leg spans, once ``legs`` of them came."""

    def complete(spans: list[ReceivedSpan]) -> bool:
        request = request_span(spans)
        return request is not None and len(legs_of(spans, request)) >= legs

    spans = await receiver.wait_for(complete)
    request = request_span(spans)
    assert request is not None
    return request, legs_of(spans, request)


async def trace_headers(url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return (await http.get(url + "/trace_headers")).json()["requests"]


async def test_a_request_is_one_trace_with_its_span_and_a_span_per_leg(cluster, receiver):
    async with traced_router(cluster, receiver) as http:
        response = await http.post("/generate", json=generate_body("one trace"))
        assert response.status_code == 200
        request, legs = await traced_request(receiver)
    assert {s.trace_id for s in receiver.spans} == {request.trace_id}
    assert request.name == "POST /generate" and request.parent_id == ""
    assert request.resource["service.name"] == "pd-router"
    attributes = request.attributes
    assert attributes["http.route"] == "/generate"
    assert attributes["http.response.status_code"] == 200
    assert attributes["pd.request_id"] == response.headers["X-Request-Id"]
    assert (attributes["pd.prefill.url"], attributes["pd.decode.url"]) == (
        cluster.prefill_urls[0],
        cluster.decode_urls[0],
    )
    assert attributes["pd.retries"] == 0 and not request.error
    assert [(leg.name, leg.kind) for leg in legs] == [
        ("prefill leg", "client"),
        ("decode leg", "client"),
    ]
    for leg, url in zip(legs, (cluster.prefill_urls[0], cluster.decode_urls[0]), strict=True):
        assert leg.attributes["url.full"] == url + "/generate"
        assert leg.attributes["pd.leg.outcome"] == "ok"
        assert leg.attributes["http.response.status_code"] == 200
        assert request.start_ns <= leg.start_ns <= leg.end_ns <= request.end_ns


async def test_each_worker_receives_the_traceparent_of_its_leg(cluster, receiver):
    async with traced_router(cluster, receiver) as http:
        response = await http.post("/generate", json=generate_body("propagated"))
        assert response.status_code == 200
        request, legs = await traced_request(receiver)
    for leg in legs:
        worker = leg.attributes["url.full"].removesuffix("/generate")
        # version-trace id-parent id-flags: the flags may carry more than "sampled" (01)
        received = {tuple(e["traceparent"].split("-")[:3]) for e in await trace_headers(worker)}
        assert ("00", request.trace_id, leg.span_id) in received


async def test_a_client_traceparent_is_continued(cluster, receiver):
    async with traced_router(cluster, receiver) as http:
        response = await http.post(
            "/generate",
            json=generate_body("continued"),
            headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
        assert response.status_code == 200
        request, legs = await traced_request(receiver)
    assert (request.trace_id, request.parent_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert {leg.trace_id for leg in legs} == {CLIENT_TRACE}


async def test_a_streamed_answer_ends_its_decode_leg_once_relayed(cluster, receiver):
    async with traced_router(cluster, receiver) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 8}  # fmt: skip
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and "[DONE]" in response.text
        request, legs = await traced_request(receiver)
    assert request.name == "POST /v1/chat/completions"
    assert request.attributes["gen_ai.request.model"] == model
    assert [leg.attributes["pd.leg.outcome"] for leg in legs] == ["ok", "ok"]


async def test_a_retried_request_has_the_legs_of_each_attempt(cluster, receiver):
    await fault(cluster.decode_urls[0], fail_next=1, fail_status=503)
    async with traced_router(cluster, receiver) as http:
        response = await http.post("/generate", json=generate_body("retried"))
        assert response.status_code == 200
        request, legs = await traced_request(receiver, legs=4)
    assert request.attributes["pd.retries"] == 1
    assert [(leg.name, leg.attributes["pd.attempt"]) for leg in legs] == [
        ("prefill leg", 1),
        ("decode leg", 1),
        ("prefill leg", 2),
        ("decode leg", 2),
    ]
    failed = legs[1]
    assert failed.error and failed.attributes["pd.leg.outcome"] == "failed"
    assert failed.attributes["http.response.status_code"] == 503
    assert failed.attributes["error.type"] == "http_5xx"
    assert legs[0].attributes["pd.leg.outcome"] in ("cancelled", "failed")
    assert [leg.attributes["pd.leg.outcome"] for leg in legs[2:]] == ["ok", "ok"]


async def test_each_sample_of_a_fanned_out_request_has_its_own_legs(cluster, receiver):
    body = {"text": "fanned", "sampling_params": {"max_new_tokens": 4, "n": 2}}
    async with traced_router(cluster, receiver) as http:
        response = await http.post("/generate", json=body)
        assert response.status_code == 200
        request, legs = await traced_request(receiver, legs=4)
    assert request.attributes["pd.retries"] == 0
    assert sorted((leg.name, leg.attributes["pd.attempt"]) for leg in legs) == [
        ("decode leg", 1),
        ("decode leg", 1),
        ("prefill leg", 1),
        ("prefill leg", 1),
    ]


async def test_each_data_plane_process_exports_its_own_spans(cluster, receiver):
    def processes() -> set[str]:
        return {s.resource["pd_router.process"] for s in receiver.spans if s.kind == "server"}

    async with traced_router(cluster, receiver, server={"workers": 2}) as http:
        for _ in range(40):
            # A new connection each time: either process may take it.
            response = await http.post("/generate", json=generate_body("n"), headers=CLOSE)
            assert response.status_code == 200
            if len(processes()) == 2:
                break
            await asyncio.sleep(0.6)
    assert processes() == {"dataplane-0", "dataplane-1"}
    instances = {
        s.resource["pd_router.process"]: s.resource["service.instance.id"] for s in receiver.spans
    }
    assert len(set(instances.values())) == 2


async def test_a_conversion_is_a_span_with_its_phases(cluster_factory, receiver):
    fleet = cluster_factory(prefill=2, decode=1, speed=0.0)
    prefill = fleet.prefill_urls[0]
    async with traced_router(fleet, receiver) as http:
        response = await convert(http, server_url=prefill, new_role="decode")
        assert response.status_code == 200 and response.json()["status"] == "succeeded"
        spans = await receiver.wait_for(lambda spans: any(s.name == "conversion" for s in spans))
    conversion = next(s for s in spans if s.name == "conversion")
    assert conversion.attributes["pd.conversion.worker"] == prefill
    assert conversion.attributes["pd.conversion.from_role"] == "prefill"
    assert conversion.attributes["pd.conversion.to_role"] == "decode"
    assert conversion.attributes["pd.conversion.started_by"] == "operator"
    assert conversion.attributes["pd.conversion.outcome"] == "succeeded"
    assert not conversion.error and conversion.parent_id == ""
    phases = sorted(
        (s for s in spans if s.parent_id == conversion.span_id), key=lambda s: s.start_ns
    )
    assert [s.name for s in phases] == ["drain", "switch", "verify"]
    for phase in phases:
        assert conversion.start_ns <= phase.start_ns <= phase.end_ns <= conversion.end_ns
    verify = phases[2]
    assert [s.name for s in spans if s.parent_id == verify.span_id] == ["canary"]


async def test_with_tracing_off_nothing_is_exported_or_propagated(cluster, receiver):
    async with traced_router(cluster, receiver, enabled=False) as http:
        response = await http.post("/generate", json=generate_body("untraced"))
        assert response.status_code == 200
        await asyncio.sleep(EXPORT_WAIT_SECS)
    assert receiver.exports == 0
    request_id = response.headers["X-Request-Id"]
    for url in cluster.urls:
        assert all(e.get("x-request-id") != request_id for e in await trace_headers(url))


IMPORTED = (
    "import asyncio, sys\n"
    "from pd_router.config import load_config\n"
    "from pd_router.runtime.router import build_app\n"
    "from pd_router.runtime.serve import start_server\n"
    "async def main():\n"
    "    config = load_config(None, {'tracing': {'enabled': sys.argv[1] == 'on'}})\n"
    "    server = await start_server(build_app(config), '127.0.0.1', 0)\n"
    "    await server.stop(0)\n"
    "asyncio.run(main())\n"
    "print(sorted(m for m in sys.modules if m.startswith('opentelemetry'))[:1])\n"
)


@pytest.mark.parametrize(("switch", "loaded"), [("off", "[]"), ("on", "['opentelemetry']")])
def test_opentelemetry_is_imported_only_with_tracing_on(switch, loaded):
    done = subprocess.run(
        [sys.executable, "-c", IMPORTED, switch], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == loaded
