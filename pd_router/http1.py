"""A small keep-alive HTTP/1.1 client for the two legs of every request.

The legs are the router's hot path: two POSTs per client request to known workers, JSON in,
JSON or SSE out. aiohttp's general-purpose client spends most of the router's CPU on them
(request objects, header multidicts, payload wrappers, tracing hooks); this client writes the
request head and body in one call on a pooled connection and parses the response in a protocol
callback, which measured about a third less CPU per request. Everything else (health probes,
fan-outs, aborts, worker control) stays on the shared aiohttp session.

Scope: POST with a bytes body; responses framed by Content-Length, chunked encoding or the end
of the connection; keep-alive unless either side says ``Connection: close``. A pooled connection
that turns out closed before any byte of the answer arrived is replaced once by a fresh one (the
worker never saw the request), so an idle timeout on the worker side is not a failure.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

HIGH_WATER = 1 << 20  # pause reading a worker when this much body is buffered, unread
LOW_WATER = 1 << 18
MAX_HEAD = 1 << 16
MAX_IDLE_PER_TARGET = 512


class UpstreamConnectError(Exception):
    """The worker could not be connected to (refused, unreachable, connect timeout)."""


class UpstreamDisconnected(Exception):
    """The worker closed the connection before its answer was complete."""


class UpstreamProtocolError(UpstreamDisconnected):
    """The worker's answer is not HTTP/1.1 the client can read (the connection is dropped)."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a worker listens and what its requests' Host header says."""

    host: str
    port: int
    host_header: str
    tls: bool

    @classmethod
    def from_url(cls, url: str) -> Target:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(parts.hostname or "", port, parts.netloc, tls)


class _Connection(asyncio.Protocol):
    """One connection; parses one response at a time into status, headers and body chunks."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = "application/octet-stream"
        self.keep_alive = True
        self.received_any = False
        self.done = False
        self._head = bytearray()
        self._head_parsed = False
        self._mode = ""
        self._remaining = 0
        self._chunk_state = "size"
        self._pending = bytearray()
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self._head_parsed:
            self._feed_body(data)
        else:
            self._feed_head(data)
        self._wake()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done and self._error is None:
            if self._head_parsed and self._mode == "eof":
                self.done = True
            else:
                detail = f": {exc}" if exc else ""
                self._error = UpstreamDisconnected(
                    f"connection closed before the answer ended{detail}"
                )
        self._wake()

    # --- parsing ----------------------------------------------------------------------------

    def _feed_head(self, data: bytes) -> None:
        start = max(0, len(self._head) - 3)
        self._head += data
        end = self._head.find(b"\r\n\r\n", start)
        if end < 0:
            if len(self._head) > MAX_HEAD:
                self._fail(UpstreamProtocolError("response head too large"))
            return
        try:
            self._parse_head(bytes(self._head[:end]))
        except (ValueError, IndexError):
            self._fail(UpstreamProtocolError("malformed response head"))
            return
        rest = bytes(self._head[end + 4 :])
        self._head = bytearray()
        self._head_parsed = True
        if self._mode == "none":
            self.done = True
        elif rest:
            self._feed_body(rest)

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, status = lines[0].split(b" ", 2)[:2]
        self.status = int(status)
        self.keep_alive = version == b"HTTP/1.1"
        length = None
        chunked = False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-type":
                self.content_type = value.split(b";", 1)[0].strip().decode("latin-1")
            elif name == b"connection":
                token = value.strip().lower()
                if token == b"close":
                    self.keep_alive = False
                elif token == b"keep-alive":
                    self.keep_alive = True
        if chunked:
            self._mode = "chunked"
        elif length is not None:
            self._mode = "length" if length else "none"
            self._remaining = length
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._mode = "none"
        else:
            self._mode = "eof"
            self.keep_alive = False

    def _feed_body(self, data: bytes) -> None:
        if self.done:
            self.keep_alive = False
            return
        if self._mode == "length":
            if len(data) >= self._remaining:
                if len(data) > self._remaining:
                    self.keep_alive = False
                data = data[: self._remaining]
                self._remaining = 0
                self.done = True
            else:
                self._remaining -= len(data)
            self._push(data)
        elif self._mode == "chunked":
            self._feed_chunked(data)
        else:
            self._push(data)

    def _feed_chunked(self, data: bytes) -> None:
        """Decode chunked framing; a partial size line or CRLF waits in ``_pending``."""
        if self._pending:
            data = bytes(self._pending) + data
            self._pending.clear()
        pos, end = 0, len(data)
        state, remaining = self._chunk_state, self._remaining
        while pos < end:
            if state == "data":
                take = min(remaining, end - pos)
                self._push(data[pos : pos + take])
                pos += take
                remaining -= take
                if remaining:
                    break
                state = "crlf"
            elif state == "crlf":
                if end - pos < 2:
                    break
                pos += 2
                state = "size"
            else:
                nl = data.find(b"\r\n", pos)
                if nl < 0:
                    break
                line, pos = data[pos:nl], nl + 2
                if state == "trailer":
                    if not line:
                        self.done = True
                        break
                    continue
                try:
                    remaining = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(UpstreamProtocolError("malformed chunk size"))
                    return
                state = "data" if remaining else "trailer"
        self._chunk_state, self._remaining = state, remaining
        if pos < end:
            if self.done:
                self.keep_alive = False
            else:
                self._pending += data[pos:]

    def _push(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # --- response API -----------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        self._reset()
        if self.transport is None:
            raise UpstreamDisconnected("connection not open")
        self.transport.writelines((head, body))

    async def wait_head(self) -> None:
        while not self._head_parsed:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def next_chunk(self) -> bytes | None:
        """The body that arrived since the last call (pieces joined, so a busy stream is
        relayed in fewer writes); None at its end."""
        while True:
            if self._chunks:
                if len(self._chunks) == 1:
                    chunk = self._chunks.popleft()
                else:
                    chunk = b"".join(self._chunks)
                    self._chunks.clear()
                self._buffered -= len(chunk)
                if self._paused and self._buffered < LOW_WATER and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return chunk
            if self.done:
                return None
            if self._error is not None:
                raise self._error
            await self._wait()

    def fail(self, error: BaseException) -> None:
        """End the current response with ``error`` (the request timed out)."""
        if not self.done:
            self._fail(error)
            self._wake()

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.close()


class Response:
    """A worker's answer: status and content type at once, the body read whole or piecewise.
    ``release()`` returns a fully read connection to the pool; ``close()`` drops it (which is
    what tells the worker that the request was abandoned)."""

    __slots__ = ("_conn", "_pool", "_target", "_timer", "content_type", "status")

    def __init__(
        self, pool: Http1Pool, target: Target, conn: _Connection, timer: asyncio.TimerHandle
    ) -> None:
        self._pool = pool
        self._target = target
        self._conn = conn
        self._timer = timer
        self.status = conn.status
        self.content_type = conn.content_type

    async def read(self) -> bytes:
        parts = []
        while (chunk := await self._conn.next_chunk()) is not None:
            parts.append(chunk)
        self.release()
        return b"".join(parts)

    async def chunks(self):
        """The body piece by piece as it arrives (an async iterator)."""
        while (chunk := await self._conn.next_chunk()) is not None:
            yield chunk

    def release(self) -> None:
        self._timer.cancel()
        conn = self._conn
        if conn.done and conn.keep_alive and not conn.closed:
            self._pool.put_back(self._target, conn)
        else:
            conn.close()

    def close(self) -> None:
        self._timer.cancel()
        self._conn.close()


class Http1Pool:
    """Idle keep-alive connections per worker, and the POST that uses them."""

    def __init__(self, *, connect_timeout: float, request_timeout: float) -> None:
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._idle: dict[Target, list[_Connection]] = {}
        self._targets: dict[str, tuple[Target, str]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _resolve(self, url: str) -> tuple[Target, str]:
        entry = self._targets.get(url)
        if entry is None:
            target = Target.from_url(url)
            path = urlsplit(url).path or "/"
            entry = self._targets[url] = (target, path)
        return entry

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send ``body``; return once the response head arrived (the body follows). Raises
        UpstreamConnectError, UpstreamDisconnected or TimeoutError."""
        target, path = self._resolve(url)
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {target.host_header}\r\n{lines}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        loop = asyncio.get_running_loop()
        conn = self._take_idle(target)
        if conn is None:
            conn = await self._connect(target)
        timer = loop.call_later(self._request_timeout, conn.fail, TimeoutError("request timeout"))
        try:
            conn.send(head, body)
            try:
                await conn.wait_head()
            except UpstreamDisconnected:
                if not conn.reused or conn.received_any:
                    raise
                conn = await self._connect(target)
                timer.cancel()
                timer = loop.call_later(
                    self._request_timeout, conn.fail, TimeoutError("request timeout")
                )
                conn.send(head, body)
                await conn.wait_head()
        except BaseException:
            timer.cancel()
            conn.close()
            raise
        return Response(self, target, conn, timer)

    def _take_idle(self, target: Target) -> _Connection | None:
        idle = self._idle.get(target)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        return None

    async def _connect(self, target: Target) -> _Connection:
        loop = asyncio.get_running_loop()
        if target.tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    _Connection, target.host, target.port, ssl=self._ssl if target.tls else None
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectError(f"cannot connect to {target.host_header}: {exc}") from exc
        return conn

    def put_back(self, target: Target, conn: _Connection) -> None:
        idle = self._idle.setdefault(target, [])
        if len(idle) >= MAX_IDLE_PER_TARGET:
            conn.close()
        else:
            idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
