"""The limits of the router's listening side, whichever server applies them
(:mod:`pd_router.dataplane.front`).

A router holds a client connection and two worker connections per request in flight, so the
file descriptors it may open bound the client connections it can serve: :class:`ClientConnections`
caps them (by default a quarter of the descriptors the process may open) and, at the cap, closes
the oldest idle one to make room, as nginx does. :class:`ClientLimits` holds the client side's
timeouts: the head of a request must be complete within ``header_timeout`` of its first byte
(against slowloris clients), a body may not pause longer than ``body_timeout``, and an idle
keep-alive connection is closed after ``keepalive_timeout``.

Balance. Data planes that share one port get their connections from the kernel's hash
(SO_REUSEPORT), which with keep-alive clients can leave one process with twice the connections
of another, and so with twice the work while another core idles. The control process, which
sees every data plane's count, tells them a ``share`` while the counts are uneven; a data plane
above it answers its next request on a surplus connection with ``Connection: close``, and the
client's new connection is placed again. Only a connection between answers moves, so nothing
in progress is cut, and a process sheds no more than its surplus.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pd_router.errors import error_body

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


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Timeouts (seconds) and the connection cap of the client side."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_connections: int


class CappedConnection(Protocol):
    """What the cap, and the server's timeout sweep and stop, need of a client connection."""

    @property
    def between_requests(self) -> bool:
        """No request in progress: idle, or a request's head still arriving."""
        ...

    def force_close(self) -> None: ...

    def check(self, now: float) -> None:
        """Apply the timeouts."""
        ...

    def close_when_idle(self) -> None: ...

    def abort(self) -> asyncio.Task[None] | None:
        """Drop the connection now; the task of the request it cancels, if any."""
        ...


class ClientConnections:
    """The open client connections of one listening socket, oldest first, and the cap on them.

    At the cap a new connection takes the place of the oldest one that has no request in
    progress (idle between requests, or still sending its header), as nginx reuses idle
    keep-alive connections when it runs out; if none of the oldest :data:`RECLAIM_SCAN` is
    such a connection, the new one is refused.
    """

    def __init__(self, limit: int, count_shed: Callable[[], object] = lambda: None) -> None:
        self.limit = limit
        self._count_shed = count_shed
        # The most connections to keep while other data planes hold fewer (None: no bound).
        self.share: int | None = None
        self._open: collections.OrderedDict[CappedConnection, None] = collections.OrderedDict()
        self._shedding: set[CappedConnection] = set()
        self._warned_at = -CAP_WARNING_INTERVAL_SECS
        self._empty: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[CappedConnection]:
        return iter(list(self._open))

    def admit(self, connection: CappedConnection) -> bool:
        """Count ``connection`` in, closing an idle one to make room; False: refuse it."""
        if len(self._open) >= self.limit:
            self._warn_at_cap()
            if not self._reclaim():
                return False
        self._open[connection] = None
        return True

    def shed(self, connection: CappedConnection) -> bool:
        """Whether ``connection`` should close after the answer it is about to get, to be
        placed again: true while this process holds more than its share, counting those
        already closing for the same reason."""
        share = self.share
        if share is None or len(self._open) - len(self._shedding) <= share:
            return False
        self._shedding.add(connection)
        self._count_shed()
        return True

    def release(self, connection: CappedConnection) -> None:
        self._open.pop(connection, None)
        self._shedding.discard(connection)
        if not self._open and self._empty is not None:
            self._empty.set()

    async def emptied(self) -> None:
        """Return once no connection is open."""
        if self._open:
            self._empty = asyncio.Event()
            await self._empty.wait()

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
