"""Decode side of the bootstrap protocol: pull a room's KV over a pooled TCP connection.

The protocol (see :mod:`pd_worker.bootstrap`) is framed, so one connection carries any number of
pulls one after another. Like the connection cache of a real transfer engine, a
:class:`KVPuller` keeps a few idle connections per prefill (``host``, ``port``) instead of paying
a TCP handshake on both workers for every request. A pooled connection the prefill has closed
meanwhile (restart, role teardown) is detected on use and replaced by one fresh connection.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import orjson

from pd_worker.errors import KVTransferError

RECONNECT_INTERVAL_SECS = 0.05
MAX_IDLE_PER_PEER = 64

Peer = tuple[str, int]
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class PeerClosed(ConnectionError):
    """The prefill closed the connection before answering (an idle pooled one went stale)."""


@dataclass(frozen=True)
class PulledKV:
    """What a decode received: the payload and the prefill that sent it."""

    payload: bytes
    source: str | None
    cached_tokens: int = 0


class KVPuller:
    """Pulls KV from prefills' bootstrap servers, reusing idle connections per prefill."""

    def __init__(self, max_idle_per_peer: int = MAX_IDLE_PER_PEER) -> None:
        self._max_idle = max_idle_per_peer
        self._idle: dict[Peer, list[Connection]] = {}
        self._closed = False

    async def pull(self, host: str, port: int, room_id: int, timeout_secs: float) -> PulledKV:
        """Pull the KV of ``room_id`` from the bootstrap server at ``host:port``.

        Refused connections are retried until ``timeout_secs`` (a prefill may be starting), as
        SGLang keeps polling the bootstrap server; any failure raises :class:`KVTransferError`.
        """
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout_secs):
                return await self._pull((host, port), room_id)
        except TimeoutError:
            elapsed = time.monotonic() - started
            raise KVTransferError(
                room_id,
                f"Request {room_id} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput",
            ) from None
        except (OSError, asyncio.IncompleteReadError, ValueError, orjson.JSONDecodeError) as exc:
            reason = f"KV transfer from {host}:{port} failed: {exc}"
            raise KVTransferError(room_id, reason) from None

    async def release(self, host: str, port: int, room_id: int, timeout_secs: float) -> None:
        """Tell the prefill at ``host:port`` that the KV of ``room_id`` has been read (raises
        :class:`KVTransferError` when it cannot be told: the prefill frees it at its timeout)."""
        try:
            async with asyncio.timeout(timeout_secs):
                await self._pull((host, port), room_id, {"room": room_id, "release": True})
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise KVTransferError(room_id, f"release to {host}:{port} failed: {exc!r}") from None

    def close(self) -> None:
        """Close every idle connection; connections in use are closed when they come back."""
        self._closed = True
        for connections in self._idle.values():
            for _, writer in connections:
                writer.close()
        self._idle.clear()

    async def _pull(
        self, peer: Peer, room_id: int, message: dict[str, object] | None = None
    ) -> PulledKV:
        request = message or {"room": room_id}
        pooled = self._take_idle(peer)
        if pooled is not None:
            try:
                return await self._exchange(peer, pooled, room_id, request)
            except PeerClosed:
                pass
        return await self._exchange(peer, await _connect(*peer), room_id, request)

    async def _exchange(
        self, peer: Peer, connection: Connection, room_id: int, request: dict[str, object]
    ) -> PulledKV:
        """One request/reply on ``connection``; it goes back to the pool only after a full reply."""
        reader, writer = connection
        reusable = False
        try:
            header = await _request(connection, request)
            if not header.get("ok"):
                reusable = True
                raise KVTransferError(room_id, str(header.get("error")))
            payload = await reader.readexactly(int(header["nbytes"]))
            reusable = True
            source = str(header.get("source", f"{peer[0]}:{peer[1]}"))
            cached = header.get("cached_tokens", 0)
            return PulledKV(payload, source, cached if isinstance(cached, int) else 0)
        finally:
            if reusable:
                self._put_idle(peer, connection)
            else:
                writer.close()

    def _take_idle(self, peer: Peer) -> Connection | None:
        connections = self._idle.get(peer)
        while connections:
            reader, writer = connections.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    def _put_idle(self, peer: Peer, connection: Connection) -> None:
        connections = self._idle.setdefault(peer, [])
        if self._closed or len(connections) >= self._max_idle:
            connection[1].close()
            return
        connections.append(connection)


async def lost_pull(room_id: int, timeout_secs: float) -> PulledKV:
    """A pull sent where no prefill listens any more (the ``stale_bootstrap`` fault): nothing
    ever answers, and it fails as a real one does at ``timeout_secs``."""
    await asyncio.sleep(timeout_secs)
    raise KVTransferError(
        room_id, f"Request {room_id} timed out after {timeout_secs:.1f}s in KVPoll.WaitingForInput"
    )


async def _request(connection: Connection, request: dict[str, object]) -> dict[str, Any]:
    """Send one request and read the reply header; a connection closed before it is PeerClosed."""
    reader, writer = connection
    try:
        writer.write(orjson.dumps(request) + b"\n")
        await writer.drain()
        line = await reader.readline()
    except ConnectionError as exc:
        raise PeerClosed(str(exc)) from None
    if not line:
        raise PeerClosed("the bootstrap server closed the connection")
    header = orjson.loads(line)
    if not isinstance(header, dict):
        raise ValueError("bootstrap reply header is not a JSON object")
    return header


async def _connect(host: str, port: int) -> Connection:
    """Open a connection, retrying refused ones until the caller's timeout cancels us."""
    while True:
        try:
            return await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(RECONNECT_INTERVAL_SECS)
