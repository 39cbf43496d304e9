"""The request metrics say what happened, against real reference workers: a stream whose end
reached the client is a 200 however quickly the client closes, a client that leaves mid-stream
is a 499, and a request the workers reject as invalid is the client's error (counted under its
status), not an upstream error."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from tests.router_helpers import generate_body, running_router

STREAMS = 20
SLOW_TOKENS = 300  # about 3 s of decoding at speed 1: a stream a client can leave midway


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


@pytest.fixture
def slow_cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=1, speed=1.0)


def metric(router, name: str, labels: dict[str, str]) -> float:
    return router.state.metrics.registry.get_sample_value(name, labels) or 0.0


def requests(router, endpoint: str, status: int) -> float:
    labels = {"endpoint": endpoint, "status": str(status)}
    return metric(router, "pd_router_requests_total", labels)


def upstream_errors(router) -> dict[tuple[str, str], float]:
    """Every upstream_errors_total sample, by (role, kind)."""
    found = {}
    for family in router.state.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "pd_router_upstream_errors_total":
                found[(sample.labels["role"], sample.labels["kind"])] = sample.value
    return found


async def read_until(port: int, path: str, body: dict, marker: bytes) -> bytes:
    """POST ``body`` on a raw connection, read until ``marker`` arrived, then close at once
    (as ``curl -N`` does when its output ends)."""
    payload = orjson.dumps(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    received = b""
    while marker not in received:
        data = await asyncio.wait_for(reader.read(65536), 30.0)
        if not data:
            break
        received += data
    writer.close()
    return received


async def settled(router, endpoint: str, count: int) -> None:
    """Wait until ``count`` requests to ``endpoint`` were counted, whatever their status."""
    for _ in range(500):
        total = sum(requests(router, endpoint, s) for s in (200, 499))
        if total >= count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} requests to {endpoint} not counted")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m", "prompt": "done", "max_tokens": 6, "stream": True}),
        ("/generate", generate_body("done", 6, stream=True)),
    ],
)
async def test_a_client_closing_right_after_done_is_counted_as_200(cluster, path, body):
    async with running_router(cluster) as router:
        for _ in range(STREAMS):
            received = await read_until(router.server.port, path, body, b"data: [DONE]")
            assert received.startswith(b"HTTP/1.1 200")
        await settled(router, path, STREAMS)
        assert requests(router, path, 200) == STREAMS
        assert requests(router, path, 499) == 0


async def test_a_client_leaving_mid_stream_is_counted_as_499(slow_cluster):
    async with running_router(slow_cluster) as router:
        path = "/v1/completions"
        body = {"model": "m", "prompt": "left early", "max_tokens": SLOW_TOKENS, "stream": True}
        received = await read_until(router.server.port, path, body, b"data: {")
        assert b"[DONE]" not in received
        await settled(router, path, 1)
        assert requests(router, path, 499) == 1
        assert requests(router, path, 200) == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": "m", "prompt": "bad", "max_tokens": -1}),
        ("/v1/completions", {"model": "m", "prompt": "bad", "max_tokens": -1, "stream": True}),
        ("/generate", generate_body("bad", -1)),
    ],
)
async def test_a_request_the_workers_reject_is_a_client_error_not_an_upstream_error(
    cluster, path, body
):
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post(path, json=body)
        assert response.status_code == 400
        assert requests(router, path, 400) == 1
        assert upstream_errors(router) == {}
        assert all(w.circuit.state.value == "closed" for w in router.state.registry)


async def test_a_request_the_workers_reject_logs_no_warning(cluster, caplog):
    caplog.set_level(logging.INFO, logger="pd_router")
    async with running_router(cluster) as router, router.client() as http:
        body = {"model": "m", "prompt": "bad", "max_tokens": -1}
        assert (await http.post("/v1/completions", json=body)).status_code == 400
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any(r.getMessage() == "upstream leg failed" for r in caplog.records)
