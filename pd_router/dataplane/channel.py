"""The control process and a data plane talk over one stream socket (a socketpair made by the
control process, inherited by the data plane): messages are JSON objects (orjson), each sent as
a 4-byte big-endian length and the bytes. A message's ``t`` names its kind.

Sending never waits: a message goes into the transport's buffer and the sender carries on, so a
data plane never blocks on a slow control process (nor the control process on a slow data
plane).

Each end sends something at least every :data:`HEARTBEAT_SECS`, even with nothing to say (the
data plane a report, the control process the in-flight totals), so that either can take a long
silence of the other for a hang.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import orjson

HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
HEARTBEAT_SECS = 1.0

Message = dict[str, Any]


class ChannelClosed(Exception):
    """The other side closed the channel (or sent something that is not a message)."""


class Channel:
    """One end of a control <-> data plane socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def over(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_MESSAGE_BYTES)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, message: Message) -> None:
        """Queue ``message`` (dropped when the channel is already closed)."""
        if self._writer.is_closing():
            return
        data = orjson.dumps(message)
        self._writer.write(HEADER.pack(len(data)) + data)

    async def receive(self) -> Message:
        """The next message; ChannelClosed at the end of the stream."""
        try:
            head = await self._reader.readexactly(HEADER.size)
            (size,) = HEADER.unpack(head)
            if size > MAX_MESSAGE_BYTES:
                raise ChannelClosed(f"message of {size} bytes")
            message = orjson.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError, orjson.JSONDecodeError) as exc:
            raise ChannelClosed(str(exc)) from None
        if not isinstance(message, dict):
            raise ChannelClosed("not a message")
        return message

    def close(self) -> None:
        self._writer.close()
