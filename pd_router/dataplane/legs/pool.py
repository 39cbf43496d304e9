"""The legs' connection pool: keep-alive HTTP/1.1 connections per worker for the two POSTs of
every request.

The legs are the router's hot path: two POSTs per client request to known workers, JSON in, JSON or
SSE out. aiohttp's general-purpose client spends most of the router's CPU on them (request objects,
header multidicts, payload wrappers, tracing hooks); this pool writes the request head and body in
one call on a pooled connection whose answers httptools parses in protocol callbacks
(:mod:`pd_router.dataplane.legs.connection`), which measured about a third less CPU per request.
Everything else (health probes, fan-outs, aborts, worker control) stays on the shared aiohttp
session.

Per worker the pool keeps at most ``max_connections_per_worker`` connections (a leg waits up to
``pool_timeout_secs`` for one) and closes idle ones after ``idle_timeout_secs``, before the
worker's own keep-alive timeout (5 s in SGLang/uvicorn) can close one under a request. A pooled
connection that still turns out closed before any byte of the answer arrived is replaced once by
a fresh one (the worker never read the request).

An https:// worker gets TLS on its connections (asyncio's ``ssl=``, the URL's host as the
name the certificate must carry) with the context the pool was given: the router's
``[tls]`` CAs and client certificate.

Every leg has a total deadline (``request_timeout``), a first-byte timeout when the caller asks
for one (time to the first byte of the body: the first event of a stream, the whole answer of a
unary request) and a stream-idle timeout between body bytes. One pool-wide ticker checks them
(a timer per leg cost more CPU than the parsing); a timeout fires up to TICK_SECS late.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

from pd_router.dataplane.legs.connection import (
    ClosedBeforeAnswer,
    OriginConnections,
    UpstreamConnectError,
    UpstreamDisconnected,
    WorkerConnection,
    local_error,
)

TICK_SECS = 0.2  # how often the pool checks its legs' timeouts and its idle connections


@dataclass(frozen=True, slots=True)
class LegLimits:
    """The ``[legs]`` section of the router's configuration: the timeouts a leg has besides
    connect and total, the wait for a pair's rendezvous (and how long a pair that missed it
    rests: :mod:`pd_router.dataplane.routing.pairs`), and the connection pool's limits per
    worker."""

    first_byte_timeout_secs: float = 300.0
    rendezvous_timeout_secs: float = 30.0
    rendezvous_cooldown_secs: float = 30.0
    stream_idle_timeout_secs: float = 120.0
    max_connections_per_worker: int = 1024
    pool_timeout_secs: float = 10.0
    idle_timeout_secs: float = 4.0


class PoolTimeout(Exception):
    """No connection to the worker became free within the pool timeout (the router's cap)."""


class PoolCounts(NamedTuple):
    """One worker's connections: open (idle + in use + connecting), idle, legs waiting."""

    open: int
    idle: int
    waiting: int


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


class Response:
    """A worker's answer: status and content type at once, the body read whole or piecewise.
    ``release()`` returns a fully read connection to the pool; ``close()`` drops it (which is
    what tells the worker that the request was abandoned)."""

    __slots__ = ("_conn", "_idle_timeout", "_pool", "content_type", "status")

    def __init__(self, pool: Http1Pool, conn: WorkerConnection, idle_timeout: float) -> None:
        self._pool = pool
        self._conn = conn
        self._idle_timeout = idle_timeout
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
        self._pool.release(self._conn, self._idle_timeout)

    def close(self) -> None:
        self._pool.discard(self._conn)


class Http1Pool:
    """Keep-alive connections per worker, and the POST that uses them."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        request_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        """``ssl_context``: verifies https:// workers (and may carry a client certificate);
        None: the stdlib's defaults, made on the first https:// connection."""
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._targets: dict[str, OriginConnections] = {}
        self._routes: dict[str, tuple[OriginConnections, str]] = {}
        self._ssl = ssl_context
        self._ticker: asyncio.TimerHandle | None = None

    def _route(self, url: str) -> tuple[OriginConnections, str]:
        route = self._routes.get(url)
        if route is None:
            key = origin(url)
            target = self._targets.get(key)
            if target is None:
                target = self._targets[key] = OriginConnections(url)
            route = self._routes[url] = (target, urlsplit(url).path or "/")
        return route

    async def post(
        self,
        url: str,
        body: bytes,
        headers: dict[str, str],
        limits: LegLimits,
        *,
        first_byte: bool = True,
    ) -> Response:
        """Send ``body``; return once the response head arrived (the body follows).
        ``first_byte``: whether the first-byte timeout applies (not to an answer that comes
        whole only at the end of a long generation). Raises UpstreamConnectError,
        UpstreamDisconnected, LegTimeout, PoolTimeout or LocalResourceError."""
        target, path = self._route(url)
        lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {target.host_header}\r\n{lines}"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode("latin-1")
        loop = asyncio.get_running_loop()
        now = loop.time()
        total = self._request_timeout
        deadline = now + total
        first = limits.first_byte_timeout_secs if first_byte else None
        idle = limits.stream_idle_timeout_secs
        conn = self._take_idle(target, now) or await self._acquire(target, limits)
        if self._ticker is None:
            self._ticker = loop.call_later(TICK_SECS, self._tick)
        try:
            try:
                conn.send(head, body, deadline, total, first, idle)
                await conn.wait_head()
            except ClosedBeforeAnswer:
                if not conn.reused:
                    raise
                conn = await self._replace(conn)
                conn.send(head, body, deadline, total, first, idle)
                await conn.wait_head()
        except BaseException:
            self.discard(conn)
            raise
        return Response(self, conn, limits.idle_timeout_secs)

    # --- connections ------------------------------------------------------------------------

    async def _acquire(self, target: OriginConnections, limits: LegLimits) -> WorkerConnection:
        """A new connection in a free slot (no idle one was left), waiting for a returned or a
        new one when the worker has ``max_connections_per_worker`` open."""
        if target.waiters or target.open >= limits.max_connections_per_worker:
            conn = await self._wait_turn(target, limits)
            if conn is not None:
                return conn
        else:
            target.open += 1
        return await self._connect(target)

    async def _wait_turn(
        self, target: OriginConnections, limits: LegLimits
    ) -> WorkerConnection | None:
        """Wait (first come, first served) until a connection is returned or a slot frees;
        the idle connection, or None with a slot reserved for a new one."""
        loop = asyncio.get_running_loop()
        timeout = limits.pool_timeout_secs
        deadline = loop.time() + timeout
        while True:
            waiter = loop.create_future()
            target.waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                self._leave_queue(target, waiter)
                if isinstance(exc, TimeoutError):
                    raise PoolTimeout(
                        f"no free connection to {target.host_header} within {timeout:g} s "
                        f"({limits.max_connections_per_worker} open)"
                    ) from None
                raise
            conn = self._take_idle(target, loop.time())
            if conn is not None:
                return conn
            if target.open < limits.max_connections_per_worker:
                target.open += 1
                return None

    def _leave_queue(self, target: OriginConnections, waiter: asyncio.Future[None]) -> None:
        """A waiting leg gives up (timeout, cancelled, aborted): out of the queue, and a wake-up
        it got but will not use goes to the next one."""
        with contextlib.suppress(ValueError):
            target.waiters.remove(waiter)
        if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
            self._pass_turn(target)

    def _pass_turn(self, target: OriginConnections) -> None:
        """Wake the next waiting leg of ``target``; it looks again for a connection or a slot."""
        waiters = target.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _take_idle(self, target: OriginConnections, now: float) -> WorkerConnection | None:
        """The most recently returned idle connection that is still usable; expired, closed
        and spoiled ones met on the way are closed."""
        idle = target.idle
        while idle:
            conn = idle.pop()
            if conn.reusable and not conn.closed and conn.expires > now:
                conn.reused = True
                target.busy.add(conn)
                return conn
            self._drop(conn)
        return None

    async def _connect(self, target: OriginConnections) -> WorkerConnection:
        """A new connection in a slot already counted in ``target.open``; the slot is given
        back when none can be made."""
        loop = asyncio.get_running_loop()
        if target.tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        epoch = target.epoch
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: WorkerConnection(target),
                    target.host,
                    target.port,
                    ssl=self._ssl if target.tls else None,
                    server_hostname=target.host if target.tls else None,
                )
        except OSError as exc:
            self._free_slot(target)
            local = local_error(exc)
            if local is not None:
                raise local from exc
            raise UpstreamConnectError(f"cannot connect to {target.host_header}: {exc}") from exc
        except BaseException:
            self._free_slot(target)
            raise
        if target.epoch != epoch and target.abort_error is not None:
            conn.counted = False
            conn.close()
            self._free_slot(target)
            raise target.abort_error
        target.busy.add(conn)
        return conn

    async def _replace(self, stale: WorkerConnection) -> WorkerConnection:
        """A fresh connection in the slot of ``stale`` (closed by the worker while idle)."""
        target = stale.target
        target.busy.discard(stale)
        stale.finish()
        stale.counted = False
        stale.close()
        return await self._connect(target)

    def _free_slot(self, target: OriginConnections) -> None:
        target.open -= 1
        if target.waiters:
            self._pass_turn(target)

    def _drop(self, conn: WorkerConnection) -> None:
        """Close ``conn`` and give its slot back (once)."""
        conn.finish()
        conn.close()
        target = conn.target
        target.busy.discard(conn)
        if conn.counted:
            conn.counted = False
            self._free_slot(target)

    def release(self, conn: WorkerConnection, idle_timeout: float) -> None:
        """Return a fully read connection to the pool (or close it when it cannot be reused)."""
        if not conn.counted:
            return
        conn.finish()
        if not (conn.done and conn.keep_alive and conn.reusable and not conn.closed):
            self._drop(conn)
            return
        target = conn.target
        target.busy.discard(conn)
        conn.expires = asyncio.get_running_loop().time() + idle_timeout
        target.idle.append(conn)
        if target.waiters:
            self._pass_turn(target)

    def discard(self, conn: WorkerConnection) -> None:
        """Drop a connection whose answer was not read to the end."""
        self._drop(conn)

    def _tick(self) -> None:
        """Every TICK_SECS while the pool has connections: end the legs whose timeouts ran out
        and close the connections idle for longer than their idle timeout. One pool-wide timer
        instead of one per leg: a timeout fires at most TICK_SECS late."""
        self._ticker = None
        now = asyncio.get_running_loop().time()
        active = False
        for target in self._targets.values():
            idle = target.idle
            while idle and (idle[0].expires <= now or idle[0].closed):
                self._drop(idle.popleft())
            for conn in tuple(target.busy):
                if conn.in_use:
                    conn.check_time(now)
            active = active or bool(idle or target.busy)
        if active:
            self._ticker = asyncio.get_running_loop().call_later(TICK_SECS, self._tick)

    # --- control ----------------------------------------------------------------------------

    def abort_target(self, url: str, error: UpstreamDisconnected) -> None:
        """End every leg on the worker at ``url`` with ``error`` (those in flight, connecting
        or waiting for a connection) and close its idle connections: the worker left service
        and its answers, if any ever come, are not waited for."""
        target = self._targets.get(origin(url))
        if target is None:
            return
        target.epoch += 1
        target.abort_error = error
        while target.idle:
            self._drop(target.idle.pop())
        for conn in list(target.busy):
            conn.fail(error)
        waiters, target.waiters = target.waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)

    def counts(self, url: str) -> PoolCounts:
        """How many connections the worker at ``url`` has (for tests and status pages)."""
        target = self._targets.get(origin(url))
        if target is None:
            return PoolCounts(0, 0, 0)
        return PoolCounts(target.open, len(target.idle), len(target.waiters))

    def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for target in self._targets.values():
            while target.idle:
                self._drop(target.idle.pop())
