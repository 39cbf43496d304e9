"""The listening side of the client server: the socket (its own, or one handed over by the
control process), the cap on open connections, the sweep that applies the connections'
timeouts, and a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

from pd_router.dataplane.front.connection import ClientConnection, RequestHandler
from pd_router.dataplane.front.listener import ClientConnections, ClientLimits, backlog_for

log = logging.getLogger("pd_router.dataplane.front")

# Bounds of the sweep's period: a quarter of the shortest timeout within them.
MIN_SWEEP_SECS = 0.05
MAX_SWEEP_SECS = 1.0
# How long requests cancelled at the end of a stop may take to abort their legs.
ABORT_WAIT_SECS = 2.0


def sweep_period(limits: ClientLimits) -> float:
    shortest = min(limits.header_timeout, limits.body_timeout, limits.keepalive_timeout)
    return min(MAX_SWEEP_SECS, max(MIN_SWEEP_SECS, shortest / 4))


class FrontServer:
    """Serves client connections with ``handler`` (HTTPS with ``ssl_context``), counted and
    capped in its data plane's ``connections``.

    With TLS a connection reaches the cap and the timeouts once its handshake is done; the
    handshake itself gets the header timeout, so a client that never finishes its hello holds
    a connection no longer than one that never sends a request head."""

    def __init__(
        self,
        handler: RequestHandler,
        limits: ClientLimits,
        ssl_context: ssl.SSLContext | None,
        connections: ClientConnections,
    ) -> None:
        self._handler = handler
        self._limits = limits
        self._ssl_context = ssl_context
        self._connections = connections
        self._server: asyncio.Server | None = None
        self._sweep: asyncio.Task[None] | None = None

    @property
    def connections(self) -> ClientConnections:
        """The open client connections, their cap and their share."""
        return self._connections

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None
    ) -> tuple[str, int]:
        """Listen on ``host``:``port`` (or on ``sock``); returns the address bound. OSError when
        it cannot be bound."""
        loop = asyncio.get_running_loop()
        limits, connections, handler = self._limits, self._connections, self._handler
        # A socket given listens again with the backlog passed here (asyncio's default: 100).
        address = {"sock": sock} if sock is not None else {"host": host, "port": port}
        self._server = await loop.create_server(
            lambda: ClientConnection(handler, limits, connections, loop),
            ssl=self._ssl_context,
            ssl_handshake_timeout=limits.header_timeout if self._ssl_context else None,
            backlog=backlog_for(limits.max_connections),
            **address,
        )
        self._sweep = loop.create_task(self._apply_timeouts())
        bound = self._server.sockets[0].getsockname()
        return bound[0], bound[1]

    async def _apply_timeouts(self) -> None:
        loop = asyncio.get_running_loop()
        period = sweep_period(self._limits)
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for connection in self._connections:
                connection.check(now)

    async def stop(self, grace_secs: float) -> None:
        """Stop accepting, close idle connections, let requests in progress finish for up to
        ``grace_secs``, then close what is left (its requests are cancelled)."""
        server = self._server
        if server is None:
            return
        self._server = None
        server.close()
        for connection in self._connections:
            connection.close_when_idle()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._connections.emptied(), grace_secs)
        cancelled = [task for c in self._connections if (task := c.abort()) is not None]
        if cancelled:
            await asyncio.wait(cancelled, timeout=ABORT_WAIT_SECS)
        if self._sweep is not None:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)
