"""The router's client side (pd_router.dataplane.front) as a client on a raw socket sees it:
HTTP/1.1 framing, pipelining, HTTP/1.0, 100-continue, compressed bodies, long heads, and the
relay of every other route to the application. Real router, real reference workers."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import orjson
import pytest

from pd_router.dataplane.link.channel import LocalChannel
from pd_router.wire import PROTOCOL_VERSION, Hello, Report
from tests.router_helpers import assert_paired, generate_body, running_router, wait_until

GIVE_UP_SECS = 10.0


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


def post(path: str, body: bytes, *headers: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: router", f"Content-Length: {len(body)}"]
    head += ["Content-Type: application/json", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def generate(prompt: str, tokens: int = 2, **extra) -> bytes:
    return orjson.dumps(generate_body(prompt, tokens, **extra))


async def read_one(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-case headers, body) of one answer framed by Content-Length, by chunks,
    or by the end of the connection."""
    async with asyncio.timeout(GIVE_UP_SECS):
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                body += await reader.readexactly(size)
                await reader.readexactly(2)
            await reader.readexactly(2)
        else:
            body = await reader.read()
    return int(status_line.split()[1]), headers, body


async def exchange(port: int, raw: bytes, answers: int = 1) -> list[tuple[int, dict, bytes]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return [await read_one(reader) for _ in range(answers)]
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_the_order_they_came(cluster):
    raw = b"".join(
        post("/generate", generate(f"pipelined {i}", 2, rid=f"pipe-{i}")) for i in range(3)
    )
    raw += b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
    async with running_router(cluster) as router:
        answers = await exchange(router.server.port, raw, answers=4)
    for i, (status, _, body) in enumerate(answers[:3]):
        assert status == 200
        assert_paired(orjson.loads(body), f"pipelined {i}", 2)
    assert answers[3][0] == 200


async def test_an_http_1_0_client_gets_its_stream_ended_by_the_close(cluster):
    raw = post("/generate", generate("old client", 3, stream=True), version="1.0")
    async with running_router(cluster) as router:
        ((status, headers, body),) = await exchange(router.server.port, raw)
    assert status == 200
    assert "transfer-encoding" not in headers
    assert headers["connection"] == "close"
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_stream_to_an_http_1_1_client_closing_after_it_is_still_chunked(cluster):
    """So the client can tell a whole stream from one cut short."""
    raw = post("/generate", generate("last one", 3, stream=True), "Connection: close")
    async with running_router(cluster) as router:
        ((status, headers, body),) = await exchange(router.server.port, raw)
    assert status == 200
    assert (headers["transfer-encoding"], headers["connection"]) == ("chunked", "close")
    assert body.endswith(b"data: [DONE]\n\n")


async def test_a_connection_moved_to_another_process_is_closed_after_its_pipelined_requests(
    cluster,
):
    raw = b"".join(post("/generate", generate(f"moving {i}", 2)) for i in range(3))
    async with running_router(cluster) as router:
        # A second data plane (in memory) with no client: the two idle connections here are
        # one over this data plane's share, and only the exchange's answers can shed one.
        control_end, quiet = LocalChannel.pair()
        router.state.dataplanes.attach(1, control_end)
        quiet.send(Hello(PROTOCOL_VERSION))
        quiet.send(Report(router.state.dataplanes.version, {}, {}, (), (), (), {}, 0))
        idle = [await asyncio.open_connection("127.0.0.1", router.server.port) for _ in range(2)]
        try:
            await wait_until(lambda: router.dataplane.connections.share == 1, 5.0, "a share")
            answers = await exchange(router.server.port, raw, answers=3)
        finally:
            for _, writer in idle:
                writer.close()
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert [headers["connection"] for _, headers, _ in answers] == [
        "keep-alive", "keep-alive", "close",
    ]  # fmt: skip


async def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body(cluster):
    body = generate("continue", 2)
    head = post("/generate", b"", "Expect: 100-continue").replace(
        b"Content-Length: 0", f"Content-Length: {len(body)}".encode()
    )
    async with running_router(cluster) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
        try:
            writer.write(head)
            async with asyncio.timeout(GIVE_UP_SECS):
                interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(body)
            status, _, answer = await read_one(reader)
        finally:
            writer.close()
    assert interim.startswith(b"HTTP/1.1 100 Continue")
    assert status == 200
    assert_paired(orjson.loads(answer), "continue", 2)


@pytest.mark.parametrize(
    "encoding,compress",
    [("gzip", gzip.compress), ("deflate", zlib.compress)],
    ids=["gzip", "deflate"],
)
async def test_a_compressed_body_is_decoded_before_it_is_routed(cluster, encoding, compress):
    raw = post("/generate", compress(generate("squeezed", 2)), f"Content-Encoding: {encoding}")
    async with running_router(cluster) as router:
        ((status, _, body),) = await exchange(router.server.port, raw)
    assert status == 200
    assert_paired(orjson.loads(body), "squeezed", 2)


async def test_a_compressed_body_that_unfolds_past_the_size_limit_gets_413(cluster):
    bomb = gzip.compress(b'{"text": "' + b"a" * (2 * 1024 * 1024) + b'"}')
    raw = post("/generate", bomb, "Content-Encoding: gzip")
    async with running_router(cluster, max_payload_size=1024 * 1024) as router:
        ((status, _, body),) = await exchange(router.server.port, raw)
    assert status == 413
    assert orjson.loads(body)["error"]["code"] == 413


async def test_a_request_target_longer_than_a_line_may_be_gets_400(cluster):
    raw = b"GET /v1/models?" + b"q" * 9000 + b" HTTP/1.1\r\nHost: router\r\n\r\n"
    async with running_router(cluster) as router:
        ((status, headers, body),) = await exchange(router.server.port, raw)
    assert status == 400
    assert headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == 400


async def test_other_routes_are_relayed_with_their_method_query_and_answer(cluster):
    raw = b"GET /conversions?limit=oops HTTP/1.1\r\nHost: router\r\nX-Request-Id: relayed-1\r\n\r\n"
    raw += b"HEAD /health HTTP/1.1\r\nHost: router\r\n\r\n"
    async with running_router(cluster) as router:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.server.port)
        try:
            writer.write(raw)
            listed = await read_one(reader)
            async with asyncio.timeout(GIVE_UP_SECS):
                head = await reader.readuntil(b"\r\n\r\n")
        finally:
            writer.close()
    status, headers, body = listed
    assert status == 400
    assert headers["x-request-id"] == "relayed-1"
    assert orjson.loads(body)["error"]["field"] == "limit"
    assert head.startswith(b"HTTP/1.1 200")


async def test_a_generation_path_answers_other_methods_with_405(cluster):
    async with running_router(cluster) as router:
        ((status, headers, body),) = await exchange(
            router.server.port, b"GET /generate HTTP/1.1\r\nHost: router\r\n\r\n"
        )
    assert status == 405
    assert headers["allow"] == "POST"
    assert orjson.loads(body)["error"]["type"] == "method_not_allowed"
