"""One keep-alive HTTP/1.1 connection to a worker, answers parsed by httptools (llhttp, the
parser uvicorn uses) in asyncio protocol callbacks, one answer at a time.

llhttp does the framing (Content-Length, chunked encoding, the end of the connection), the
keep-alive decision (``Connection`` and version tokens) and rejects what is not HTTP/1.1
(conflicting or malformed lengths, bad chunk framing); 1xx interim answers are skipped. A
connection that receives a byte nobody asked for (after a finished answer, or while idle in the
pool) is never used again: those bytes would be read as the next request's answer. Reading is
paused while too much of a body waits unread. The leg's timeouts are checked from outside
(:meth:`WorkerConnection.check_time`, by the pool's ticker).
"""

from __future__ import annotations

import asyncio
import collections
import errno
from enum import StrEnum
from urllib.parse import urlsplit

import httptools

HIGH_WATER = 1 << 20  # pause reading a worker when this much body is buffered, unread
LOW_WATER = 1 << 18
MAX_HEAD = 1 << 16
DEFAULT_CONTENT_TYPE = "application/octet-stream"
# The router's own resources running out: never the worker's fault.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Phase(StrEnum):
    """Which of a leg's timeouts fired."""

    FIRST_BYTE = "first_byte"
    STREAM_IDLE = "stream_idle"
    TOTAL = "total"


class UpstreamConnectError(Exception):
    """The worker could not be connected to (refused, unreachable, connect timeout)."""


class UpstreamDisconnected(Exception):
    """The worker closed the connection before its answer was complete."""


class UpstreamProtocolError(UpstreamDisconnected):
    """The worker's answer is not HTTP/1.1 the client can read (the connection is dropped)."""


class WorkerUnavailable(UpstreamDisconnected):
    """The router ended the leg because its worker left service (unhealthy, failed, removed)."""


class ClosedBeforeAnswer(UpstreamDisconnected):
    """The connection closed before any byte of the answer: on a pooled connection the worker
    closed it while idle and never read the request, so a fresh connection may resend it."""


class LegTimeout(TimeoutError):
    """A leg ran out of time; ``phase`` says which timeout fired."""

    def __init__(self, phase: Phase, seconds: float) -> None:
        super().__init__(f"{phase.value.replace('_', ' ')} timeout ({seconds:g} s)")
        self.phase = phase


class LocalResourceError(Exception):
    """The router itself ran out of file descriptors, socket buffers or memory."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.errno = code


def local_error(exc: BaseException | None) -> LocalResourceError | None:
    """``exc`` as a LocalResourceError when it is one of the router's own resources running
    out, else None."""
    if isinstance(exc, OSError) and exc.errno in LOCAL_ERRNOS:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        return LocalResourceError(f"router out of resources ({name}): {exc.strerror}", exc.errno)
    return None


class _UnsolicitedBytes(Exception):
    """Bytes after a finished answer (raised inside the parser to stop it)."""


class WorkerConnection(asyncio.Protocol):
    """One connection; parses one response at a time into status, headers and body chunks."""

    def __init__(self, target: OriginConnections) -> None:
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True  # nothing unexpected happened: may carry another request
        self.counted = True  # holds one of the target's ``open`` slots
        self.reused = False
        self.in_use = False
        self.expires = 0.0
        self._total = self._deadline = self._first_byte_by = self._idle = 0.0
        self._first_byte: float | None = None
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.content_type = DEFAULT_CONTENT_TYPE
        self.keep_alive = True
        self.received_any = False
        self.head_done = False
        self.done = False
        self._interim = False
        self._length_framed = False
        self._head_bytes = 0
        self._body_started = False
        self._last_data = 0.0
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    # --- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.in_use or self.done:
            self._drop_unsolicited()
            return
        self.received_any = True
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done:
                self._drop_unsolicited()
            else:
                self._fail(UpstreamProtocolError(f"malformed response: {exc}"))
        else:
            if not self.head_done:
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD:
                    self._fail(UpstreamProtocolError("response head too large"))
        self._wake()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if not self.in_use or self.done or self._error is not None:
            self._wake()
            return
        if self.head_done and not self._length_framed and exc is None:
            self.done = True  # the body ran until the end of the connection
            self.keep_alive = False
        elif (local := local_error(exc)) is not None:
            self._error = local
        elif not self.received_any:
            detail = f": {exc}" if exc else ""
            self._error = ClosedBeforeAnswer(f"connection closed before any answer{detail}")
        else:
            detail = f": {exc}" if exc else ""
            self._error = UpstreamDisconnected(f"connection closed before the answer ended{detail}")
        self._wake()

    # --- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:
            raise _UnsolicitedBytes

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.split(b";", 1)[0].strip().decode("latin-1")
        elif name == b"content-length":
            self._length_framed = True
        elif name == b"transfer-encoding":
            last = value.rsplit(b",", 1)[-1].strip().lower()
            self._length_framed = last == b"chunked"

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            raise UpstreamProtocolError("the worker switched protocols")
        if status < 200:
            self._interim = True
            return
        self.status = status
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self._body_started = True
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self.content_type = DEFAULT_CONTENT_TYPE
            self._length_framed = False
            return
        self.done = True
        self.keep_alive = self._parser.should_keep_alive()

    # --- timeouts ---------------------------------------------------------------------------

    def check_time(self, now: float) -> None:
        """Fail the leg if one of its timeouts ran out (called by the pool's ticker): the total,
        the first byte of the body, or the stream-idle time since the last byte (not while the
        router's own reader is behind and reading is paused)."""
        if self.done or self._error is not None:
            return
        if now >= self._deadline:
            self.fail(LegTimeout(Phase.TOTAL, self._total))
        elif not self._body_started:
            if self._first_byte is not None and now >= self._first_byte_by:
                self.fail(LegTimeout(Phase.FIRST_BYTE, self._first_byte))
        elif self._paused:
            self._last_data = now
        elif now - self._last_data >= self._idle:
            self.fail(LegTimeout(Phase.STREAM_IDLE, self._idle))

    # --- internals --------------------------------------------------------------------------

    def _drop_unsolicited(self) -> None:
        """Bytes no request asked for: this connection's framing can no longer be trusted."""
        self.reusable = False
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.keep_alive = False
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

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

    def send(
        self, head: bytes, body: bytes, deadline: float, total: float, first_byte: float | None,
        idle: float,
    ) -> None:  # fmt: skip
        """Write the request in one call. The leg ends at ``deadline`` (loop time; ``total``
        seconds after it began), its first-byte timeout counts from now."""
        self._reset()
        if self.transport is None or self.closed:
            raise ClosedBeforeAnswer("connection not open")
        self.in_use = True
        self._total = total
        self._deadline = deadline
        self._first_byte = first_byte
        if first_byte is not None:
            self._first_byte_by = self._loop.time() + first_byte
        self._idle = idle
        self.transport.writelines((head, body))

    async def wait_head(self) -> None:
        while not self.head_done:
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
                    self._last_data = self._loop.time()
                    self.transport.resume_reading()
                return chunk
            if self.done:
                return None
            if self._error is not None:
                raise self._error
            await self._wait()

    def fail(self, error: BaseException) -> None:
        """End the current response with ``error`` (a timeout, or the worker left service)."""
        if not self.done and self._error is None:
            self._fail(error)
            self._wake()

    def finish(self) -> None:
        """The leg is over: no timeout applies any more."""
        self.in_use = False

    def close(self) -> None:
        """Drop the socket at once (abort, not a graceful close): what is still unsent belongs
        to an exchange nobody waits for. A graceful close would keep the request body in memory
        until the worker had read it all, and the worker would then serve it."""
        self.keep_alive = False
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.abort()


class OriginConnections:
    """One worker's connections (keyed by origin): idle ones (newest last), how many are open
    or opening (counted against the cap), the ones in use and the legs waiting for one."""

    __slots__ = (
        "abort_error", "busy", "epoch", "host", "host_header", "idle", "open", "port", "tls",
        "waiters",
    )  # fmt: skip

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc
        self.idle: collections.deque[WorkerConnection] = collections.deque()
        self.busy: set[WorkerConnection] = set()
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.open = 0
        self.epoch = 0
        self.abort_error: UpstreamDisconnected | None = None
