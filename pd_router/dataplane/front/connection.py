"""One client connection: httptools parses its requests, which are served one at a time in
the order they came (pipelined ones wait their turn), each in a task of its own so that a
client that goes away cancels its request.

The limits a production listener needs are kept here, checked by the server's sweep
(:meth:`ClientConnection.check`) rather than by a timer per request:

- the head of a request must be complete within ``header_timeout`` of its first byte, else the
  connection is closed (what nginx and Go's ``ReadHeaderTimeout`` do against slowloris);
- a body that pauses longer than ``body_timeout`` between two reads is answered with 408;
- a connection idle between requests longer than ``keepalive_timeout`` is closed;
- a request refused from its head (too large, over the body budget) or one the parser rejects
  is answered in turn with the router's JSON error, and the connection closed after it;
- a connection its process holds beyond its share (:class:`ClientConnections`) gets its next
  answer with ``Connection: close``, so that the client's next connection is placed again.

A connection the router ends while the client may still be sending (a refused body, a head
cut off) is closed the way nginx's ``lingering_close`` does: the router's side is shut for
writing and what still arrives is read and dropped for up to :data:`LINGER_SECS`, so the
client reads the answer (or the end of the stream) instead of a reset.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol

import httptools

from pd_router.dataplane.front.listener import BUSY_RESPONSE, ClientConnections, ClientLimits
from pd_router.dataplane.front.reply import Reply
from pd_router.dataplane.front.request import ClientRequest
from pd_router.errors import BadRequest, PayloadTooLarge, RequestTimeout, RouterError

log = logging.getLogger("pd_router.dataplane.front")

# Complete requests queued behind the one being served before the connection stops reading.
PIPELINE_DEPTH = 4
# The longest request target and header field (name and value), as aiohttp's parser allows,
# the most header fields, and the most bytes a head may take before it is complete.
MAX_LINE = 8190
MAX_HEADERS = 128
MAX_HEAD_BYTES = MAX_HEADERS * MAX_LINE
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LINGER_SECS = 5.0


class RequestHandler(Protocol):
    """What serves a connection's requests (:class:`~.dispatch.Dispatcher`)."""

    max_body: int

    def check_head(self, request: ClientRequest) -> RouterError | None:
        """Why a request whose head arrived is refused before its body is read, or None (its
        body admitted)."""
        ...

    def release(self, request: ClientRequest) -> None:
        """Give back what :meth:`check_head` admitted for a request never served."""
        ...

    async def __call__(self, request: ClientRequest, reply: Reply) -> None:
        """Answer ``request`` (never raises but CancelledError)."""
        ...


class StopParsing(Exception):
    """Raised from a parser callback once the rest of the connection's bytes are not read."""


def decode_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in raw:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return headers


class ClientConnection(asyncio.Protocol):
    """One client connection (see the module's docstring)."""

    def __init__(
        self,
        handler: RequestHandler,
        limits: ClientLimits,
        connections: ClientConnections,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._handler = handler
        self._limits = limits
        self._connections = connections
        self._loop = loop
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._admitted = False
        self._lost = False
        self._closing = False
        # The request being parsed; its head is complete once ``_head_started`` is None.
        self._incoming: ClientRequest | None = None
        self._head_started: float | None = None
        self._head_bytes = 0
        self._body_read_at = 0.0
        self._queue: collections.deque[ClientRequest] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._idle_since = loop.time()
        # No more bytes are parsed: a refused request is queued, the connection ends after it.
        self._discarding = False
        self._reading_paused = False
        self._lingering = False
        self._writing_paused = False
        self._drain: asyncio.Future[None] | None = None

    # --- state seen by the server ----------------------------------------------------------

    @property
    def between_requests(self) -> bool:
        """No request in progress: idle, or a request's head still arriving."""
        return (
            self._task is None
            and not self._queue
            and (self._incoming is None or self._head_started is not None)
        )

    def force_close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def linger_close(self) -> None:
        """End the connection while the client may still send (see the module's docstring)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        self._lingering = True
        transport.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._loop.call_later(LINGER_SECS, transport.close)

    def abort(self) -> asyncio.Task[None] | None:
        """Drop the connection now; returns the task of the request it cancels, if any."""
        task = self._task
        if self._transport is not None:
            self._transport.abort()
        return task

    def close_when_idle(self) -> None:
        """Stop serving: close now if idle, else once the request in progress is answered."""
        self._closing = True
        if self.between_requests:
            self.force_close()

    def check(self, now: float) -> None:
        """Apply the timeouts (called by the server's sweep)."""
        if self._lost:
            return
        limits = self._limits
        incoming = self._incoming
        if incoming is not None and not self._discarding:
            started = self._head_started
            if started is not None:
                if now - started > limits.header_timeout and self.between_requests:
                    log.debug("closing a connection whose request head did not arrive in time")
                    self.linger_close()
            elif self._reading_paused:
                # The router is not reading (its queue is full): the pause is not the client's.
                self._body_read_at = now
            elif now - self._body_read_at > limits.body_timeout:
                self._refuse(
                    incoming,
                    RequestTimeout(
                        f"request body paused for more than {limits.body_timeout:g} s "
                        "(client_body_timeout_secs)"
                    ),
                )
                self._serve_next()
        elif (
            self._task is None
            and not self._queue
            and now - self._idle_since > limits.keepalive_timeout
        ):
            self.force_close()

    # --- connection lifecycle ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        if not self._connections.admit(self):
            transport.write(BUSY_RESPONSE)  # type: ignore[attr-defined]
            transport.close()
            return
        self._admitted = True

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        if self._admitted:
            self._connections.release(self)
        if self._task is not None:
            self._task.cancel()
        if self._incoming is not None:
            self._handler.release(self._incoming)
        for request in self._queue:
            self._handler.release(request)
        self._queue.clear()
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("client closed the connection"))
            drain.exception()

    def data_received(self, data: bytes) -> None:
        if self._discarding or self._lingering or not self._admitted:
            return
        if self._incoming is None or self._head_started is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(self._incoming or ClientRequest(), BadRequest("request head too long"))
                self._serve_next()
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, StopParsing):
                log.error("client request parsing failed", exc_info=exc.__context__)
                self._refuse(self._incoming or ClientRequest(), BadRequest("malformed request"))
        except httptools.HttpParserUpgrade:
            # An upgrade is not offered: the request is answered as a plain one, and the
            # connection ends after it.
            if self._queue:
                self._queue[-1].keep_alive = False
            self._stop_reading()
        except httptools.HttpParserError as exc:
            message = " ".join(str(exc).split()) or "malformed request"
            request = self._incoming or ClientRequest()
            self._refuse(request, BadRequest(f"malformed request: {message}"))
        else:
            if self._incoming is not None and self._head_started is None:
                self._body_read_at = self._loop.time()
        self._serve_next()

    # --- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._incoming = ClientRequest()
        self._head_started = self._loop.time()

    def on_url(self, url: bytes) -> None:
        request = self._incoming
        assert request is not None
        request.target += url
        if len(request.target) > MAX_LINE:
            self._refuse(request, BadRequest(f"request target longer than {MAX_LINE} bytes"))
            raise StopParsing

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._incoming
        assert request is not None
        request.raw_headers.append((name, value))
        if len(name) + len(value) > MAX_LINE or len(request.raw_headers) > MAX_HEADERS:
            self._refuse(request, BadRequest("request header too long, or too many headers"))
            raise StopParsing

    def on_headers_complete(self) -> None:
        request = self._incoming
        assert request is not None
        parser = self._parser
        request.method = parser.get_method().decode("ascii", "replace")
        request.version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        target = request.target
        end = target.find(b"?")
        request.path = (target if end < 0 else target[:end]).decode("latin-1")
        request.headers = decode_headers(request.raw_headers)
        self._head_started = None
        self._head_bytes = 0
        self._body_read_at = self._loop.time()
        rejection = self._handler.check_head(request)
        if rejection is not None:
            self._refuse(request, rejection)
            raise StopParsing
        if (
            request.headers.get("expect", "").lower() == "100-continue"
            and self._task is None
            and not self._queue
        ):
            self._write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        request = self._incoming
        assert request is not None
        request.body += body
        if len(request.body) > self._handler.max_body:
            self._refuse(
                request,
                PayloadTooLarge(
                    f"request body is over the limit of {self._handler.max_body} bytes "
                    "(max_payload_size)"
                ),
            )
            raise StopParsing

    def on_message_complete(self) -> None:
        request = self._incoming
        assert request is not None
        self._incoming = None
        self._queue.append(request)
        if len(self._queue) >= PIPELINE_DEPTH and not self._reading_paused:
            self._reading_paused = True
            self._transport.pause_reading()  # type: ignore[union-attr]

    # --- serving ---------------------------------------------------------------------------

    def _refuse(self, request: ClientRequest, error: RouterError) -> None:
        """Answer ``request`` with ``error`` in its turn, then end the connection; read no
        more of it."""
        if self._incoming is request:
            self._incoming = None
        request.rejection = error
        request.keep_alive = False
        self._queue.append(request)
        self._stop_reading()

    def _stop_reading(self) -> None:
        self._discarding = True
        self._head_started = None
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _serve_next(self) -> None:
        if self._task is not None or not self._queue or self._lost:
            return
        request = self._queue.popleft()
        if self._reading_paused and not self._discarding and len(self._queue) < PIPELINE_DEPTH:
            self._reading_paused = False
            self._transport.resume_reading()  # type: ignore[union-attr]
        self._task = self._loop.create_task(self._serve(request))

    async def _serve(self, request: ClientRequest) -> None:
        reply = Reply(self, request)
        if reply.keep_alive and not self._queue and self._connections.shed(self):
            reply.keep_alive = False
        try:
            await self._handler(request, reply)
        finally:
            self._task = None
        if self._lost:
            return
        if self._discarding and not self._queue:
            self.linger_close()
            return
        if self._closing or not (reply.finished and reply.keep_alive):
            self.force_close()
            return
        self._idle_since = self._loop.time()
        self._serve_next()

    # --- writing (the reply's side) --------------------------------------------------------

    def _write(self, data: bytes) -> None:
        self._transport.write(data)  # type: ignore[union-attr]

    def write(self, data: bytes) -> None:
        transport = self._transport
        if self._lost or transport is None or transport.is_closing():
            raise ConnectionResetError("client closed the connection")
        transport.write(data)

    async def drain(self) -> None:
        if self._lost:
            raise ConnectionResetError("client closed the connection")
        if not self._writing_paused:
            return
        self._drain = drain = self._loop.create_future()
        try:
            await drain
        finally:
            self._drain = None

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)
