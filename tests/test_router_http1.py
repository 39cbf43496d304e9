"""The legs' HTTP/1.1 client against real loopback servers that answer with scripted bytes:
framing (Content-Length, chunked in any split, end of connection), answers a kept parser must
reject or skip (1xx, conflicting lengths, bad chunk framing, bytes nobody asked for, connection
tokens), keep-alive reuse, a stale pooled connection, the pool's limits, the leg timeouts and
connection errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from pd_router.dataplane.legs.connection import (
    LegTimeout,
    Phase,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    WorkerUnavailable,
)
from pd_router.dataplane.legs.pool import Http1Pool, LegLimits, PoolTimeout
from tests.router_helpers import wait_until


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length"))
    return await reader.readexactly(length)


CLOSE = None  # in an answer's pieces: close the connection here


@dataclass
class Server:
    url: str
    connections: int = 0  # accepted so far
    open: int = 0  # open now
    most_open: int = 0


@contextlib.asynccontextmanager
async def server(answers: list[list[bytes | float | None]]) -> AsyncIterator[Server]:
    """A server that answers the i-th request it reads (on any connection) with ``answers[i]``
    (the last one repeats), written piece by piece; a float sleeps that long, CLOSE closes the
    connection. It counts the connections it accepts."""
    count = 0
    state = Server("")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        state.connections += 1
        state.open += 1
        state.most_open = max(state.most_open, state.open)
        try:
            while True:
                await read_request(reader)
                pieces = answers[min(count, len(answers) - 1)]
                count += 1
                for piece in pieces:
                    if piece is CLOSE:
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            state.open -= 1
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    state.url = f"http://127.0.0.1:{port}/generate"
    try:
        yield state
    finally:
        srv.close()


LIMITS = LegLimits()


def pool(timeout: float = 5.0) -> Http1Pool:
    return Http1Pool(connect_timeout=1.0, request_timeout=timeout)


async def post(client: Http1Pool, url: str, limits: LegLimits = LIMITS, **kwargs):
    return await client.post(url, b"{}", {"Content-Type": "application/json"}, limits, **kwargs)


OK_JSON = (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'
)


async def test_content_length_body_is_read_and_connection_reused():
    async with server([[OK_JSON]]) as srv:
        client = pool()
        for _ in range(3):
            response = await post(client, srv.url)
            assert (response.status, response.content_type) == (200, "application/json")
            assert await response.read() == b'{"ok": true}'
        assert client.counts(srv.url).idle == 1
        assert srv.connections == 1
        client.close()


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
async def test_chunked_body_survives_any_split(split):
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
        b"5\r\ndata:\r\n10;ext=1\r\n 0123456789abcde\r\n0\r\n\r\n"
    )
    pieces: list[bytes | float | None] = [raw[i : i + split] for i in range(0, len(raw), split)]
    async with server([pieces]) as srv:
        client = pool()
        response = await post(client, srv.url)
        assert response.content_type == "text/event-stream"
        assert b"".join([c async for c in response.chunks()]) == b"data: 0123456789abcde"
        client.close()


async def test_body_until_close_when_no_length_is_given():
    raw = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"
    async with server([[raw, CLOSE]]) as srv:
        client = pool()
        response = await post(client, srv.url)
        assert await response.read() == b"until the end"
        client.close()


async def test_interim_1xx_answers_are_skipped_for_the_final_one():
    raw = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + OK_JSON
    async with server([[raw]]) as srv:
        client = pool()
        for _ in range(2):
            response = await post(client, srv.url)
            assert (response.status, response.content_type) == (200, "application/json")
            assert await response.read() == b'{"ok": true}'
        client.close()


async def test_interim_answer_in_its_own_packet_is_skipped():
    async with server([[b"HTTP/1.1 100 Continue\r\n\r\n", 0.05, OK_JSON]]) as srv:
        client = pool()
        response = await post(client, srv.url)
        assert response.status == 200
        assert await response.read() == b'{"ok": true}'
        client.close()


@pytest.mark.parametrize(
    "lengths",
    [
        b"Content-Length: 2\r\nContent-Length: 12",
        b"Content-Length: 12, 2",
        b"Content-Length: -1",
        b"Content-Length: 1_2",
        b"Content-Length: +12",
        b"Content-Length: 12\r\nTransfer-Encoding: chunked",
    ],
)
async def test_conflicting_or_malformed_content_length_is_rejected(lengths):
    raw = b"HTTP/1.1 200 OK\r\n" + lengths + b'\r\n\r\n{"ok": true}'
    async with server([[raw]]) as srv:
        client = pool()
        with pytest.raises(UpstreamProtocolError):
            await post(client, srv.url)
        assert client.counts(srv.url).open == 0  # the connection is dropped
        client.close()


async def test_chunk_without_crlf_after_its_data_is_rejected():
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY0\r\n\r\n"
    async with server([[raw]]) as srv:
        client = pool()
        response = await post(client, srv.url)
        with pytest.raises(UpstreamProtocolError):
            await response.read()
        client.close()


async def test_bytes_after_a_bodiless_answer_drop_the_connection():
    raw = b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"
    async with server([[raw], [OK_JSON]]) as srv:
        client = pool()
        response = await post(client, srv.url)
        assert (response.status, await response.read()) == (204, b"")
        response = await post(client, srv.url)
        assert await response.read() == b'{"ok": true}'
        assert srv.connections == 2
        client.close()


async def test_bytes_arriving_on_an_idle_connection_mean_it_is_not_reused():
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"
    async with server([[OK_JSON, 0.05, stray], [OK_JSON]]) as srv:
        client = pool()
        assert await (await post(client, srv.url)).read() == b'{"ok": true}'
        await asyncio.sleep(0.3)  # the stray answer arrives while the connection is idle
        assert await (await post(client, srv.url)).read() == b'{"ok": true}'
        assert srv.connections == 2
        client.close()


@pytest.mark.parametrize(
    "connection", [b"Connection: keep-alive, close", b"Connection: Upgrade, Close"]
)
async def test_close_among_connection_tokens_ends_keep_alive(connection):
    raw = b"HTTP/1.1 200 OK\r\n" + connection + b"\r\nContent-Length: 2\r\n\r\nok"
    async with server([[raw]]) as srv:
        client = pool()
        for _ in range(2):
            assert await (await post(client, srv.url)).read() == b"ok"
        assert srv.connections == 2
        client.close()


async def test_transfer_coding_that_does_not_end_in_chunked_runs_until_close():
    body = b"3\r\nabc\r\n0\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: notchunked\r\n\r\n" + body
    async with server([[raw, CLOSE]]) as srv:
        client = pool()
        assert await (await post(client, srv.url)).read() == body
        client.close()


async def test_gzip_then_chunked_is_chunked():
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    async with server([[raw]]) as srv:
        client = pool()
        for _ in range(2):
            assert await (await post(client, srv.url)).read() == b"abc"
        assert srv.connections == 1
        client.close()


async def test_pooled_connection_closed_before_answering_is_replaced_once():
    async with server([[OK_JSON], [CLOSE], [OK_JSON]]) as srv:
        client = pool()
        assert await (await post(client, srv.url)).read() == b'{"ok": true}'
        assert await (await post(client, srv.url)).read() == b'{"ok": true}'
        client.close()


async def test_fresh_connection_closed_before_answering_is_a_disconnect():
    async with server([[CLOSE]]) as srv:
        client = pool()
        with pytest.raises(UpstreamDisconnected):
            await post(client, srv.url)
        client.close()


async def test_answer_cut_mid_body_is_a_disconnect():
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part"
    async with server([[raw, CLOSE]]) as srv:
        client = pool()
        response = await post(client, srv.url)
        with pytest.raises(UpstreamDisconnected):
            await response.read()
        client.close()


async def test_silent_worker_times_out():
    async with server([[b""]]) as srv:
        client = pool(timeout=0.2)
        with pytest.raises(LegTimeout) as caught:
            await post(client, srv.url)
        assert caught.value.phase is Phase.TOTAL
        client.close()


async def test_refused_connection_is_a_connect_error(free_port):
    client = pool()
    with pytest.raises(UpstreamConnectError):
        await post(client, f"http://127.0.0.1:{free_port()}/generate")


async def test_garbage_answer_is_a_protocol_error():
    async with server([[b"NOT HTTP AT ALL\r\n\r\n"]]) as srv:
        client = pool()
        with pytest.raises(UpstreamProtocolError):
            await post(client, srv.url)
        client.close()


async def test_endless_response_head_is_a_protocol_error():
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"x" * 70_000
    async with server([[head]]) as srv:
        client = pool()
        with pytest.raises(UpstreamProtocolError):
            await post(client, srv.url)
        client.close()


async def test_chunked_trailer_fields_end_the_body_and_keep_the_connection():
    raw = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nX-Checksum: 1\r\n\r\n"
    )
    async with server([[raw]]) as srv:
        client = pool()
        for _ in range(2):
            assert await (await post(client, srv.url)).read() == b"abc"
        assert client.counts(srv.url).idle == 1
        client.close()


# --- leg timeouts ---------------------------------------------------------------------------

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def test_stream_without_a_first_event_hits_the_first_byte_timeout():
    async with server([[SSE_HEAD]]) as srv:
        client = pool(timeout=30.0)
        limits = LegLimits(first_byte_timeout_secs=0.3)
        response = await post(client, srv.url, limits)
        started = time.monotonic()
        with pytest.raises(LegTimeout) as caught:
            await response.read()
        assert caught.value.phase is Phase.FIRST_BYTE
        assert time.monotonic() - started < 10.0
        client.close()


async def test_answer_without_first_byte_timeout_waits_for_the_total():
    async with server([[0.6, OK_JSON]]) as srv:
        client = pool(timeout=30.0)
        limits = LegLimits(first_byte_timeout_secs=0.2)
        response = await post(client, srv.url, limits, first_byte=False)
        assert await response.read() == b'{"ok": true}'
        client.close()


async def test_stream_that_stalls_after_its_first_event_hits_the_idle_timeout():
    async with server([[SSE_HEAD + b"6\r\ndata:1\r\n"]]) as srv:
        client = pool(timeout=30.0)
        limits = LegLimits(first_byte_timeout_secs=30.0, stream_idle_timeout_secs=0.3)
        response = await post(client, srv.url, limits)
        pieces = response.chunks()
        assert await anext(pieces) == b"data:1"
        started = time.monotonic()
        with pytest.raises(LegTimeout) as caught:
            await anext(pieces)
        assert caught.value.phase is Phase.STREAM_IDLE
        assert time.monotonic() - started < 10.0  # not the first-byte or the total timeout
        client.close()


async def test_steady_stream_outlives_its_idle_timeout():
    events: list[bytes | float | None] = [SSE_HEAD]
    for _ in range(8):
        events += [b"6\r\ndata:1\r\n", 0.1]
    events.append(b"0\r\n\r\n")
    async with server([events]) as srv:
        client = pool(timeout=30.0)
        response = await post(client, srv.url, LegLimits(stream_idle_timeout_secs=1.0))
        assert await response.read() == b"data:1" * 8
        client.close()


# --- the pool's limits ----------------------------------------------------------------------


async def test_legs_beyond_the_cap_wait_for_a_connection():
    async with server([[0.2, OK_JSON]]) as srv:
        client = pool()
        limits = LegLimits(max_connections_per_worker=2)

        async def one() -> bytes:
            return await (await post(client, srv.url, limits)).read()

        results = await asyncio.gather(*(one() for _ in range(5)))
        assert results == [b'{"ok": true}'] * 5
        assert srv.most_open == 2
        assert client.counts(srv.url) == (2, 2, 0)
        client.close()


async def test_leg_waiting_past_the_pool_timeout_fails():
    async with server([[1.0, OK_JSON]]) as srv:
        client = pool()
        limits = LegLimits(max_connections_per_worker=1, pool_timeout_secs=0.1)
        first = asyncio.create_task(post(client, srv.url, limits))
        await asyncio.sleep(0.05)
        with pytest.raises(PoolTimeout):
            await post(client, srv.url, limits)
        await (await first).read()
        assert client.counts(srv.url).waiting == 0
        client.close()


async def test_idle_connections_are_closed_after_the_idle_timeout():
    async with server([[OK_JSON]]) as srv:
        client = pool()
        limits = LegLimits(idle_timeout_secs=0.2)
        await (await post(client, srv.url, limits)).read()
        # closed by the router: the worker's keep-alive never runs out
        await wait_until(lambda: srv.open == 0, 5.0, "idle connection closed")
        assert client.counts(srv.url) == (0, 0, 0)
        await (await post(client, srv.url, limits)).read()
        assert srv.connections == 2
        client.close()


# --- ending every leg on a worker -----------------------------------------------------------


async def test_abort_target_ends_legs_in_flight_and_waiting_and_closes_idle_ones():
    async with server([[OK_JSON], [60.0]]) as srv:
        client = pool(timeout=60.0)
        limits = LegLimits(max_connections_per_worker=2)
        await (await post(client, srv.url, limits)).read()  # one idle connection
        legs = [asyncio.create_task(post(client, srv.url, limits)) for _ in range(3)]
        await wait_until(lambda: client.counts(srv.url).waiting == 1, 5.0, "a leg waiting")
        assert client.counts(srv.url) == (2, 0, 1)
        worker_url = srv.url.removesuffix("/generate")  # the worker's URL, as the registry has it
        client.abort_target(worker_url, WorkerUnavailable("worker left service"))
        for leg in legs:
            with pytest.raises(WorkerUnavailable):
                await asyncio.wait_for(leg, 5.0)
        assert client.counts(srv.url) == (0, 0, 0)
        client.close()


async def test_abort_target_ends_a_stream_after_its_first_event():
    async with server([[SSE_HEAD + b"6\r\ndata:1\r\n", 60.0]]) as srv:
        client = pool(timeout=60.0)
        response = await post(client, srv.url)
        pieces = response.chunks()
        assert await anext(pieces) == b"data:1"
        client.abort_target(srv.url, WorkerUnavailable("worker left service"))
        with pytest.raises(WorkerUnavailable):
            await asyncio.wait_for(anext(pieces), 5.0)
        response.close()
        assert client.counts(srv.url).open == 0
        client.close()
