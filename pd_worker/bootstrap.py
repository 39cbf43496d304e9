"""KV hand-off between prefill and decode over a real TCP connection.

Each worker runs a :class:`BootstrapServer` on its bootstrap port for its whole life (like SGLang
with ``--enable-pd-role-switch``, the listener survives role switches). A prefill request
registers its ``bootstrap_room`` in the :class:`RoomRegistry` and publishes the KV payload once its
forward is done. A decode request connects with :func:`pull_kv`, names its room, and receives the
payload bytes on that connection. Protocol (one request per connection):

    decode -> prefill   {"room": <int>}\\n
    prefill -> decode   {"ok": true, "nbytes": <int>, "source": "<prefill url>"}\\n <payload bytes>
                     or {"ok": false, "error": "<reason>"}\\n
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

from pd_worker.errors import KVTransferError

log = logging.getLogger(__name__)

RECONNECT_INTERVAL_SECS = 0.05


@dataclass
class Room:
    """One prefill request's KV, waiting to be pulled by its decode."""

    room_id: int
    num_tokens: int
    payload: asyncio.Future[bytes] = field(default_factory=asyncio.Future)
    pulled: asyncio.Future[None] = field(default_factory=asyncio.Future)


class RoomRegistry:
    """Rooms of in-flight prefill requests, and decode connections waiting for a room to appear."""

    def __init__(self) -> None:
        self._rooms: dict[int, Room] = {}
        self._appeared: dict[int, asyncio.Event] = {}

    def __contains__(self, room_id: int) -> bool:
        return room_id in self._rooms

    def __len__(self) -> int:
        return len(self._rooms)

    def open(self, room_id: int, num_tokens: int) -> Room:
        """Register a room for a prefill request; wakes decodes already waiting for it."""
        room = Room(room_id, num_tokens)
        self._rooms[room_id] = room
        event = self._appeared.pop(room_id, None)
        if event is not None:
            event.set()
        return room

    def close(self, room_id: int) -> None:
        """Forget a room (pulled, timed out or aborted)."""
        room = self._rooms.pop(room_id, None)
        if room is not None and not room.payload.done():
            room.payload.cancel()

    async def wait_for(self, room_id: int, wait_secs: float) -> Room | None:
        """The room once it is registered, or None after ``wait_secs`` seconds."""
        if room_id in self._rooms:
            return self._rooms[room_id]
        event = self._appeared.setdefault(room_id, asyncio.Event())
        try:
            async with asyncio.timeout(wait_secs):
                await event.wait()
        except TimeoutError:
            return None
        finally:
            if self._appeared.get(room_id) is event and not event.is_set():
                del self._appeared[room_id]
        return self._rooms.get(room_id)


class BootstrapServer:
    """asyncio TCP listener serving rooms' KV payloads to decodes."""

    def __init__(
        self,
        host: str,
        port: int,
        rooms: RoomRegistry,
        source: str,
        *,
        room_wait_secs: float,
        before_send: Callable[[Room], Awaitable[None]],
        is_hung: Callable[[], bool],
    ) -> None:
        self._host = host
        self._port = port
        self._rooms = rooms
        self._source = source
        self._room_wait_secs = room_wait_secs
        self._before_send = before_send
        self._is_hung = is_hung
        self._server: asyncio.Server | None = None
        self._hung: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Bind the listener (raises OSError when the port is taken)."""
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    async def stop(self) -> None:
        """Close the listener and every open connection."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._hung):
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._is_hung():
                await self._hang(reader, writer)
                return
            request = orjson.loads(await reader.readline())
            await self._serve_room(int(request["room"]), writer)
        except (OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            log.debug("bootstrap connection dropped: %s", exc)
        finally:
            writer.close()

    async def _hang(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Fault ``hang_bootstrap``: accept, then never answer until the peer gives up."""
        self._hung.add(writer)
        try:
            await reader.read()
        finally:
            self._hung.discard(writer)

    async def _serve_room(self, room_id: int, writer: asyncio.StreamWriter) -> None:
        room = await self._rooms.wait_for(room_id, self._room_wait_secs)
        if room is None:
            await self._reply_error(writer, f"bootstrap_room {room_id} not found")
            return
        try:
            payload = await asyncio.shield(room.payload)
        except asyncio.CancelledError:
            if not room.payload.cancelled():
                raise
            await self._reply_error(writer, f"bootstrap_room {room_id} was freed")
            return
        await self._before_send(room)
        header = {"ok": True, "nbytes": len(payload), "source": self._source}
        writer.write(orjson.dumps(header) + b"\n" + payload)
        await writer.drain()
        if not room.pulled.done():
            room.pulled.set_result(None)

    @staticmethod
    async def _reply_error(writer: asyncio.StreamWriter, message: str) -> None:
        writer.write(orjson.dumps({"ok": False, "error": message}) + b"\n")
        await writer.drain()


@dataclass(frozen=True)
class PulledKV:
    """What a decode received: the payload and the prefill that sent it."""

    payload: bytes
    source: str


async def pull_kv(host: str, port: int, room_id: int, timeout_secs: float) -> PulledKV:
    """Connect to a prefill's bootstrap server and pull the KV of ``room_id``.

    Refused connections are retried until ``timeout_secs`` (a prefill may be starting), as SGLang
    keeps polling the bootstrap server; any failure raises :class:`KVTransferError`.
    """
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_secs):
            reader, writer = await _connect(host, port)
            try:
                writer.write(orjson.dumps({"room": room_id}) + b"\n")
                await writer.drain()
                header = orjson.loads(await reader.readline())
                if not header.get("ok"):
                    raise KVTransferError(room_id, str(header.get("error")))
                payload = await reader.readexactly(int(header["nbytes"]))
                return PulledKV(payload, str(header.get("source", f"{host}:{port}")))
            finally:
                writer.close()
    except TimeoutError:
        elapsed = time.monotonic() - started
        raise KVTransferError(
            room_id, f"Request {room_id} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
        ) from None
    except (OSError, asyncio.IncompleteReadError, ValueError, orjson.JSONDecodeError) as exc:
        raise KVTransferError(room_id, f"KV transfer from {host}:{port} failed: {exc}") from None


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection, retrying refused ones until the caller's timeout cancels us."""
    while True:
        try:
            return await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(RECONNECT_INTERVAL_SECS)
