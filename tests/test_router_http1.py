"""The legs' HTTP/1.1 client against real loopback servers that answer with scripted bytes:
framing (Content-Length, chunked in any split, end of connection), keep-alive reuse, a stale
pooled connection, timeouts and connection errors."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pd_router.http1 import Http1Pool, UpstreamConnectError, UpstreamDisconnected


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return await reader.readexactly(length)


CLOSE = None  # in an answer's pieces: close the connection here


@contextlib.asynccontextmanager
async def server(answers: list[list[bytes | None]]) -> AsyncIterator[str]:
    """A server that answers the i-th request it reads (on any connection) with ``answers[i]``
    (the last one repeats), written piece by piece; CLOSE closes the connection."""
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                await read_request(reader)
                pieces = answers[min(count, len(answers) - 1)]
                count += 1
                for piece in pieces:
                    if piece is CLOSE:
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/generate"
    finally:
        srv.close()


def pool(timeout: float = 5.0) -> Http1Pool:
    return Http1Pool(connect_timeout=1.0, request_timeout=timeout)


OK_JSON = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'
)


async def test_content_length_body_is_read_and_connection_reused():
    async with server([[OK_JSON]]) as url:
        client = pool()
        for _ in range(3):
            response = await client.post(url, b"{}", {"Content-Type": "application/json"})
            assert (response.status, response.content_type) == (200, "application/json")
            assert await response.read() == b'{"ok": true}'
        assert sum(len(idle) for idle in client._idle.values()) == 1
        client.close()


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
async def test_chunked_body_survives_any_split(split):
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
        b"5\r\ndata:\r\n10;ext=1\r\n 0123456789abcde\r\n0\r\n\r\n"
    )
    pieces = [raw[i : i + split] for i in range(0, len(raw), split)]
    async with server([pieces]) as url:
        client = pool()
        response = await client.post(url, b"{}", {})
        assert response.content_type == "text/event-stream"
        assert b"".join([c async for c in response.chunks()]) == b"data: 0123456789abcde"
        client.close()


async def test_body_until_close_when_no_length_is_given():
    raw = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"
    async with server([[raw, CLOSE]]) as url:
        client = pool()
        response = await client.post(url, b"{}", {})
        assert await response.read() == b"until the end"
        client.close()


async def test_pooled_connection_closed_before_answering_is_replaced_once():
    async with server([[OK_JSON], [CLOSE], [OK_JSON]]) as url:
        client = pool()
        assert await (await client.post(url, b"{}", {})).read() == b'{"ok": true}'
        assert await (await client.post(url, b"{}", {})).read() == b'{"ok": true}'
        client.close()


async def test_fresh_connection_closed_before_answering_is_a_disconnect():
    async with server([[CLOSE]]) as url:
        client = pool()
        with pytest.raises(UpstreamDisconnected):
            await client.post(url, b"{}", {})
        client.close()


async def test_answer_cut_mid_body_is_a_disconnect():
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
    async with server([[raw, CLOSE]]) as url:
        client = pool()
        response = await client.post(url, b"{}", {})
        with pytest.raises(UpstreamDisconnected):
            await response.read()
        client.close()


async def test_silent_worker_times_out():
    async with server([[b""]]) as url:
        client = pool(timeout=0.2)
        with pytest.raises(TimeoutError):
            await client.post(url, b"{}", {})
        client.close()


async def test_refused_connection_is_a_connect_error(free_port):
    client = pool()
    with pytest.raises(UpstreamConnectError):
        await client.post(f"http://127.0.0.1:{free_port()}/generate", b"{}", {})


async def test_garbage_answer_is_a_protocol_error():
    async with server([[b"NOT HTTP AT ALL\r\n\r\n"]]) as url:
        client = pool()
        with pytest.raises(UpstreamDisconnected):
            await client.post(url, b"{}", {})
        client.close()


async def test_chunked_trailer_fields_end_the_body_and_keep_the_connection():
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nX-Checksum: 1\r\n\r\n"
    )
    async with server([[raw]]) as url:
        client = pool()
        for _ in range(2):
            assert await (await client.post(url, b"{}", {})).read() == b"abc"
        assert sum(len(idle) for idle in client._idle.values()) == 1
        client.close()
