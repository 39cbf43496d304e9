"""The router's listening side: aiohttp's HTTP server protocol with the limits it lacks.

aiohttp closes a connection that sits idle between requests (the keep-alive timeout), but waits
without limit for a request that arrives slowly (a slowloris client sends its header a byte at a
time), and accepts connections until the process runs out of file descriptors, after which the
router cannot open connections to its workers either. :class:`ClientProtocol` adds:

- a header timeout: the head of a request must be complete within ``header_timeout`` of its
  first byte, else the connection is closed (what nginx and Go's ``ReadHeaderTimeout`` do);
- a body timeout: a request body that pauses longer than ``body_timeout`` between two reads
  fails its request with 408;
- a cap on open connections (:class:`ClientConnections`), by default a quarter of the file
  descriptors the process may open;
- the router's JSON error body for requests aiohttp's parser rejects (bad request line, header
  too long, bad chunking), which aiohttp answers in plain text.

Besides its public methods it relies on three details of aiohttp: parsed requests queue in
``RequestHandler._messages``, ``RequestHandler._waiter`` is pending exactly while the connection
waits for its next request (aiohttp's own keep-alive check reads it the same way), and
``BaseRequest._read_bytes`` caches a body read whole (see :func:`release_body`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import socket
import ssl
import time
from dataclasses import dataclass

from aiohttp import StreamReader, web

from pd_router.errors import RequestTimeout, error_body, http_error_type, json_error

log = logging.getLogger("pd_router.dataplane.listener")

# File descriptors kept out of the client budget: the listening socket, the event loop,
# standard streams, log files, DNS lookups.
RESERVED_FDS = 64
MIN_CONNECTIONS = 16
MAX_BACKLOG = 1024
# Connections looked at (oldest first) for one to close when the cap is reached.
RECLAIM_SCAN = 64
CAP_WARNING_INTERVAL_SECS = 60.0


def busy_response() -> bytes:
    """The whole answer to a connection refused at the cap (no request has been read)."""
    body = error_body(503, "service_unavailable", "too many client connections; retry shortly")
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


BUSY_RESPONSE = busy_response()


def fd_limit() -> int:
    """The soft limit on open file descriptors."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> int:
    """Raise the soft file descriptor limit to the hard one (as Go programs do at start-up): a
    router holds a client connection and two worker connections per request in flight, and
    the common soft default of 1024 is reached long before the CPU is. Returns the new soft
    limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= soft:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def default_max_connections(nofile: int) -> int:
    """Client connections that leave room for the rest: each request in flight also holds a
    connection to its prefill and one to its decode, and connections just accepted count
    before they are refused (up to the listen backlog, see :func:`backlog_for`). A quarter of
    what is left after :data:`RESERVED_FDS`."""
    return max(MIN_CONNECTIONS, (nofile - RESERVED_FDS) // 4)


def backlog_for(max_connections: int) -> int:
    """The listen backlog: the most connections accepted in one go before the cap is applied
    to them, so it is no larger than the cap."""
    return max(1, min(MAX_BACKLOG, max_connections))


def release_body(request: web.BaseRequest) -> None:
    """Drop the body aiohttp cached on ``request`` once it is answered. A keep-alive connection
    keeps its last request until the next one arrives (a local of the connection's loop), and
    with it the whole body: a client that sent a large prompt and then went idle pinned it."""
    request._read_bytes = None


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Timeouts (seconds) and the connection cap of the client side."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int


class ClientConnections:
    """The open client connections of one listening socket, oldest first, and the cap on them.

    At the cap a new connection takes the place of the oldest one that has no request in
    progress (idle between requests, or still sending its header), as nginx reuses idle
    keep-alive connections when it runs out; if none of the oldest :data:`RECLAIM_SCAN` is
    such a connection, the new one is refused.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: collections.OrderedDict[ClientProtocol, None] = collections.OrderedDict()
        self._warned_at = -CAP_WARNING_INTERVAL_SECS

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, connection: ClientProtocol) -> bool:
        """Count ``connection`` in, closing an idle one to make room; False: refuse it."""
        if len(self._open) >= self.limit:
            self._warn_at_cap()
            if not self._reclaim():
                return False
        self._open[connection] = None
        return True

    def release(self, connection: ClientProtocol) -> None:
        self._open.pop(connection, None)

    def _reclaim(self) -> bool:
        """Close the oldest connection without a request in progress. Busy connections met on
        the way move to the back, so a later search does not look at them again first."""
        for _ in range(min(RECLAIM_SCAN, len(self._open))):
            connection, _ = self._open.popitem(last=False)
            if connection.between_requests:
                connection.force_close()
                return True
            self._open[connection] = None
        return False

    def _warn_at_cap(self) -> None:
        now = time.monotonic()
        if now - self._warned_at >= CAP_WARNING_INTERVAL_SECS:
            self._warned_at = now
            log.warning(
                "client connection cap reached (%d): closing idle connections, refusing new "
                "ones while every connection has a request in progress",
                self.limit,
            )


class ClientProtocol(web.RequestHandler):
    """One client connection: aiohttp's request handler with a deadline on reading each
    request, a place under the connection cap, and JSON error bodies for malformed requests."""

    __slots__ = (
        "_admitted",
        "_body",
        "_connections",
        "_head_started",
        "_last_read",
        "_limits",
        "_read_timer",
    )

    def __init__(
        self,
        manager: web.Server,
        limits: ClientLimits,
        connections: ClientConnections,
        *,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(
            manager, loop=loop, keepalive_timeout=limits.keepalive_timeout, access_log=None
        )
        self._limits = limits
        self._connections = connections
        self._admitted = False
        self._read_timer: asyncio.TimerHandle | None = None
        self._head_started: float | None = None
        self._body: StreamReader | None = None
        self._last_read = 0.0

    @property
    def between_requests(self) -> bool:
        """No request in progress: idle, or a request's head still arriving."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    # --- connection lifecycle ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._connections.admit(self):
            self.close()
            transport.write(BUSY_RESPONSE)  # type: ignore[attr-defined]
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._admitted:
            self._connections.release(self)
            super().connection_lost(exc)

    # --- reading deadlines ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        queued = len(self._messages)
        super().data_received(data)
        if len(self._messages) > queued:
            self._head_received(self._messages[-1][1])
        elif self._body is not None:
            if self._body.is_eof():
                self._body = None
            else:
                self._last_read = self._loop.time()
        elif self._head_started is None and data:
            self._head_started = now = self._loop.time()
            self._wake_at(now + self._limits.header_timeout)

    def _head_received(self, body: StreamReader) -> None:
        self._head_started = None
        if body.is_eof():
            self._body = None
            return
        self._body = body
        self._last_read = now = self._loop.time()
        self._wake_at(now + self._limits.body_timeout)

    def _wake_at(self, when: float) -> None:
        """Make sure the read timer fires no later than ``when``."""
        timer = self._read_timer
        if timer is not None:
            if timer.when() <= when:
                return
            timer.cancel()
        self._read_timer = self._loop.call_at(when, self._on_read_timer)

    def _on_read_timer(self) -> None:
        self._read_timer = None
        now = self._loop.time()
        if self._body is not None:
            self._check_body(self._body, now)
        elif self._head_started is not None:
            self._check_head(self._head_started, now)

    def _check_head(self, started: float, now: float) -> None:
        deadline = started + self._limits.header_timeout
        if now < deadline:
            self._wake_at(deadline)
            return
        if not self.between_requests:
            # A pipelined head waiting behind a request in progress: look again later.
            self._wake_at(now + self._limits.header_timeout)
            return
        log.debug("closing a connection whose request head did not arrive in time")
        self.force_close()

    def _check_body(self, body: StreamReader, now: float) -> None:
        if body.is_eof():
            self._body = None
            return
        if self._reading_paused:
            # The router is not reading (its buffer is full): the pause is not the client's.
            self._last_read = now
        deadline = self._last_read + self._limits.body_timeout
        if now < deadline:
            self._wake_at(deadline)
            return
        self._body = None
        body.set_exception(
            RequestTimeout(
                f"request body paused for more than {self._limits.body_timeout:g} s "
                "(client_body_timeout_secs)"
            )
        )

    # --- errors aiohttp answers itself --------------------------------------------------------

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The answer to a request aiohttp's parser rejected (or, should one ever escape the
        router's middleware, to an unhandled error), in the router's error shape."""
        if status >= 500:
            self.log_exception("error handling a request", exc_info=exc)
            text = "internal router error"
        else:
            log.debug("malformed request: %s", message, exc_info=exc)
            text = " ".join((message or "malformed request").split())
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was started already; cannot send an error")
        response = json_error(status, http_error_type(status), text)
        response.force_close()
        return response


class ClientSite(web.BaseSite):
    """A TCP listening socket whose connections are :class:`ClientProtocol` (aiohttp's
    ``TCPSite`` with its own protocol factory), HTTPS when given an SSL context.

    With TLS a connection reaches :class:`ClientProtocol` (and its cap and timeouts) once its
    handshake is done; the handshake itself gets the header timeout, so a client that opens a
    connection and never finishes its hello holds it no longer than one that never sends a
    request head."""

    __slots__ = ("_host", "_limits", "_port", "_sock")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        limits: ClientLimits,
        ssl_context: ssl.SSLContext | None = None,
        *,
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(
            runner, backlog=backlog_for(limits.max_connections), ssl_context=ssl_context
        )
        self._host = host
        self._port = port
        self._limits = limits
        # A listening socket made elsewhere (a data plane's, given by its control process);
        # None: bind ``host`` and ``port``.
        self._sock = sock

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        scheme = "https" if self._ssl_context is not None else "http"
        return f"{scheme}://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        limits = self._limits
        connections = ClientConnections(limits.max_connections)
        address = {"sock": self._sock} if self._sock is not None else {
            "host": self._host, "port": self._port, "backlog": self._backlog,
        }  # fmt: skip
        self._server = await loop.create_server(
            lambda: ClientProtocol(server, limits, connections, loop=loop),
            ssl=self._ssl_context,
            ssl_handshake_timeout=limits.header_timeout if self._ssl_context else None,
            **address,
        )
