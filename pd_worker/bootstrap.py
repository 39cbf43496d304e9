"""KV hand-off between prefill and decode over a real TCP connection.

Each worker runs a :class:`BootstrapServer` on its bootstrap port for its whole life (like SGLang
with ``--enable-pd-role-switch``, the listener survives role switches). A prefill request
registers its ``bootstrap_room`` in the :class:`RoomRegistry` and publishes the KV payload once its
forward is done. A decode request (:class:`~pd_worker.kv_pull.KVPuller`) names its room on a
connection and receives the payload bytes on it. The protocol is framed, so a connection carries
any number of requests one after another (the decode keeps a few open per prefill):

    decode -> prefill   {"room": <int>}\\n
    prefill -> decode   {"ok": true, "nbytes": <int>, "source": "<prefill url>",
                         "cached_tokens": <int>}\\n <payload bytes>
                     or {"ok": false, "error": "<reason>"}\\n
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

log = logging.getLogger(__name__)


@dataclass
class Room:
    """One prefill request's KV, waiting to be pulled by its decode."""

    room_id: int
    num_tokens: int
    # Prompt tokens the prefill's prefix cache served; the decode reports them as SGLang's
    # decode reports the prefill's count (``meta_info.cached_tokens``).
    cached_tokens: int = 0
    payload: asyncio.Future[bytes] = field(default_factory=asyncio.Future)
    pulled: asyncio.Future[None] = field(default_factory=asyncio.Future)
    # Set when the decode says it has read the KV out of the prefill's pool (the torch plane's
    # decode pulls the bytes after the payload named them; the prefill holds them until then).
    released: asyncio.Future[None] = field(default_factory=asyncio.Future)


class RoomRegistry:
    """Rooms of in-flight prefill requests, and decode connections waiting for a room to appear."""

    def __init__(self) -> None:
        self._rooms: dict[int, Room] = {}
        self._appeared: dict[int, asyncio.Event] = {}

    def __contains__(self, room_id: object) -> bool:
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

    def get(self, room_id: int) -> Room | None:
        return self._rooms.get(room_id)

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
        rooms: RoomRegistry,
        source: str,
        *,
        room_wait_secs: float,
        before_send: Callable[[Room], Awaitable[None]],
        is_hung: Callable[[], bool],
        after_send: Callable[[Room], None] = lambda room: None,
    ) -> None:
        self._host = host
        self._rooms = rooms
        self._source = source
        self._room_wait_secs = room_wait_secs
        self._before_send = before_send
        self._after_send = after_send
        self._is_hung = is_hung
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    @property
    def num_connections(self) -> int:
        """Open decode connections (a decode keeps its pooled ones open between pulls)."""
        return len(self._connections)

    @property
    def port(self) -> int:
        """The port the listener is bound to (known once started)."""
        if self._server is None:
            raise RuntimeError("bootstrap server not started")
        return self._server.sockets[0].getsockname()[1]

    async def start(self, port: int) -> None:
        """Bind the listener to ``port`` (0: a free port the system picks); raises OSError
        when the port is taken."""
        self._server = await asyncio.start_server(self._serve, self._host, port)

    async def stop(self) -> None:
        """Close the listener and every open connection."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the requests of one connection in order until the decode closes it."""
        self._connections.add(writer)
        try:
            while line := await reader.readline():
                if self._is_hung():
                    # Fault hang_bootstrap: never answer; wait until the decode gives up.
                    await reader.read()
                    return
                request = orjson.loads(line)
                if request.get("release"):
                    await self._release_room(int(request["room"]), writer)
                else:
                    await self._serve_room(int(request["room"]), writer)
        except (OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
            log.debug("bootstrap connection dropped: %s", exc)
        finally:
            self._connections.discard(writer)
            writer.close()

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
        header = {
            "ok": True,
            "nbytes": len(payload),
            "source": self._source,
            "cached_tokens": room.cached_tokens,
        }
        writer.write(orjson.dumps(header) + b"\n" + payload)
        await writer.drain()
        self._after_send(room)
        if not room.pulled.done():
            room.pulled.set_result(None)

    async def _release_room(self, room_id: int, writer: asyncio.StreamWriter) -> None:
        """The decode has read the room's KV: its prefill may free the slots."""
        room = self._rooms.get(room_id)
        if room is None:
            await self._reply_error(writer, f"bootstrap_room {room_id} not found")
            return
        if not room.released.done():
            room.released.set_result(None)
        writer.write(orjson.dumps({"ok": True, "nbytes": 0}) + b"\n")
        await writer.drain()

    @staticmethod
    async def _reply_error(writer: asyncio.StreamWriter, message: str) -> None:
        writer.write(orjson.dumps({"ok": False, "error": message}) + b"\n")
        await writer.drain()
