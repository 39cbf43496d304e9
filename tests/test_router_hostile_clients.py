"""Clients that are slow on purpose, send malformed HTTP or bodies the router cannot route, or
open more connections than the router has file descriptors: each gets a bounded, JSON-shaped
answer (or a closed connection), and the router keeps serving everyone else. Raw sockets
against a real router in front of real reference workers."""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import httpx
import orjson
import pytest

from tests.router_helpers import assert_paired, generate_body, running_router
from tests.router_process import router_process

SLOW_BYTE_INTERVAL_SECS = 0.2
GIVE_UP_SECS = 10.0
JSON = {"Content-Type": "application/json"}
SHORT_TIMEOUT_SECS = 1.0


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


@pytest.fixture(scope="module")
def slow_cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=1.0)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def read_answer(reader: asyncio.StreamReader, within: float = GIVE_UP_SECS) -> bytes:
    """Everything the router sends until it closes the connection (b"" if it sent nothing)."""
    chunks = []
    async with asyncio.timeout(within):
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    """(status, lower-case headers, JSON body) of one HTTP/1.1 answer framed by Content-Length
    (the router may keep the connection open after it, to drain an unread body)."""
    async with asyncio.timeout(GIVE_UP_SECS):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines)}
        body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, orjson.loads(body)


def assert_error_shape(body: Any, status: int) -> None:
    error = body["error"]
    assert {"message", "type", "code"} <= set(error)
    assert error["code"] == status
    assert error["message"]


async def send_slowly(port: int, head: bytes) -> tuple[bytes, float]:
    """Send ``head`` one byte every SLOW_BYTE_INTERVAL_SECS (starting over when it is all
    sent) until the router closes the connection; (what it answered, seconds until then)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = loop.time()
    answer = asyncio.create_task(read_answer(reader, GIVE_UP_SECS))
    try:
        position = 0
        while not answer.done() and loop.time() - started < GIVE_UP_SECS:
            try:
                writer.write(head[position : position + 1])
                await writer.drain()
            except ConnectionError:
                break
            position = (position + 1) % len(head)
            await asyncio.wait({answer}, timeout=SLOW_BYTE_INTERVAL_SECS)
        data = await answer
        return data, loop.time() - started
    finally:
        writer.close()


async def test_a_header_sent_a_byte_at_a_time_is_cut_off_at_the_header_timeout(cluster):
    head = b"POST /generate HTTP/1.1\r\nHost: router\r\nX-Padding: " + b"a" * 4096
    async with running_router(cluster, client_header_timeout_secs=SHORT_TIMEOUT_SECS) as router:
        answer, elapsed = await send_slowly(router.server.port, head)
        async with router.client() as http:
            served = await http.post("/generate", json=generate_body("after slowloris", 2))
    assert answer == b""
    assert elapsed < GIVE_UP_SECS
    assert_paired(served.json(), "after slowloris", 2)


async def test_an_idle_connection_is_closed_at_the_keepalive_timeout(cluster):
    async with running_router(cluster, client_keepalive_timeout_secs=SHORT_TIMEOUT_SECS) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
        try:
            answer = await read_answer(reader)
        finally:
            writer.close()
    assert answer == b""


async def test_a_body_that_stops_arriving_gets_408(cluster):
    head = b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    async with running_router(cluster, client_body_timeout_secs=SHORT_TIMEOUT_SECS) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
        try:
            writer.write(head + b"Content-Length: 1000\r\n\r\n" + b'{"text": "')
            status, _, body = await read_response(reader)
        finally:
            writer.close()
    assert status == 408
    assert_error_shape(body, 408)


async def test_a_declared_body_over_the_limit_gets_413_before_it_is_sent(cluster):
    async with running_router(cluster) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
        try:
            writer.write(b"POST /generate HTTP/1.1\r\nHost: router\r\n")
            writer.write(b"Content-Length: 99999999999\r\n\r\n")
            status, headers, body = await read_response(reader)
        finally:
            writer.close()
    assert status == 413
    assert headers["content-type"].startswith("application/json")
    assert_error_shape(body, 413)


MALFORMED = {
    "bad request line": b"GARBAGE\r\n\r\n",
    "header too long": b"GET /health HTTP/1.1\r\nHost: r\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
    "bad chunk size": (
        b"POST /generate HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n"
    ),
    "bad header line": b"GET /health HTTP/1.1\r\nHost r\r\n\r\n",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_http_gets_a_json_400(cluster, raw):
    async with running_router(cluster) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
        try:
            writer.write(raw)
            status, headers, body = await read_response(reader)
        finally:
            writer.close()
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert_error_shape(body, 400)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [300, 1000])
async def test_json_nested_too_deep_in_a_passed_through_field_gets_400(cluster, depth):
    body = b'{"text": "deep", "sampling_params": {"max_new_tokens": 2}, "extra": '
    async with running_router(cluster) as router, router.client() as http:
        answer = await http.post(
            "/generate",
            content=body + nested(depth) + b"}",
            headers={"Content-Type": "application/json"},
        )
    assert answer.status_code == 400
    assert_error_shape(answer.json(), 400)


async def test_json_nested_as_deep_as_the_router_can_forward_is_served(cluster):
    body = b'{"text": "deep", "sampling_params": {"max_new_tokens": 2}, "extra": '
    async with running_router(cluster) as router, router.client() as http:
        answer = await http.post(
            "/generate",
            content=body + nested(250) + b"}",
            headers={"Content-Type": "application/json"},
        )
    assert_paired(answer.json(), "deep", 2)


async def test_a_body_that_is_not_the_gzip_its_content_encoding_says_gets_400(cluster):
    body = orjson.dumps(generate_body("not gzip", 2))
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    async with running_router(cluster) as router, router.client() as http:
        answer = await http.post("/generate", content=body, headers=headers)
    assert answer.status_code == 400
    assert_error_shape(answer.json(), 400)


async def test_at_the_connection_cap_a_new_client_takes_the_place_of_a_slow_one(cluster):
    async with running_router(cluster, max_client_connections=4) as router:
        port = router.server.port
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(12)]
        try:
            for _, writer in slow:
                writer.write(b"GET /health HTTP/1.1\r\n")
                await writer.drain()
            async with router.client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                served = [
                    await http.post("/generate", json=generate_body(f"capped {i}", 2))
                    for i in range(5)
                ]
        finally:
            for _, writer in slow:
                writer.close()
    for i, answer in enumerate(served):
        assert_paired(answer.json(), f"capped {i}", 2)


async def test_at_the_connection_cap_with_every_connection_busy_a_new_one_gets_503(slow_cluster):
    async with (
        running_router(slow_cluster, max_client_connections=2) as router,
        router.client() as http,
    ):
        streams = [
            await http.send(
                http.build_request(
                    "POST", "/generate", json=generate_body(f"busy {i}", 300, stream=True)
                ),
                stream=True,
            )
            for i in range(2)
        ]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
            try:
                writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
                status, headers, body = await read_response(reader)
            finally:
                writer.close()
        finally:
            for stream in streams:
                await stream.aclose()
    assert status == 503
    assert headers["retry-after"] == "1"
    assert_error_shape(body, 503)


ROUTER_NOFILE = 512
SLOW_CLIENTS = 600


async def open_slow_clients(port: int, count: int) -> list[asyncio.StreamWriter]:
    """``count`` connections that each sent the first line of a request and nothing more."""
    writers = []
    for _ in range(count):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        writer.write(b"GET /health HTTP/1.1\r\n")
        writers.append(writer)
    return writers


def ensure_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"this test opens {needed} sockets; the open file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


async def test_more_slow_clients_than_file_descriptors_leave_the_router_serving(cluster):
    ensure_fd_limit(SLOW_CLIENTS + 256)
    async with router_process(
        prefill=cluster.prefill_urls,
        decode=cluster.decode_urls,
        nofile=ROUTER_NOFILE,
        client_header_timeout_secs=60.0,
    ) as router:
        slow = await open_slow_clients(router.port, SLOW_CLIENTS)
        try:
            async with router.client(
                timeout=10.0, limits=httpx.Limits(max_keepalive_connections=0)
            ) as http:
                served = [
                    await http.post("/generate", json=generate_body(f"crowded {i}", 2))
                    for i in range(20)
                ]
                metrics = (await http.get("/metrics")).text
            open_fds = router.open_fds()
        finally:
            for writer in slow:
                writer.close()
        assert router.alive()
    assert len(slow) > ROUTER_NOFILE
    for i, answer in enumerate(served):
        assert_paired(answer.json(), f"crowded {i}", 2)
    assert open_fds < ROUTER_NOFILE
    circuits = [
        line for line in metrics.splitlines() if line.startswith("pd_router_circuit_state{")
    ]
    assert circuits and all(line.endswith(" 0.0") for line in circuits)
    assert 'kind="connect"' not in metrics
