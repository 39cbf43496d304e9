"""The control side and a data plane talk over a channel. Between processes (``--workers N``)
it is one stream socket (a socketpair made by the control process, inherited by the data
plane): each message (:mod:`pd_router.wire`) is encoded, and sent as a 4-byte big-endian length
and the bytes. In one process (``--workers 1``, the data plane beside the control side) it is a
:class:`LocalChannel`: the same typed, immutable messages handed over as they are.

Sending never waits: a message goes into the transport's buffer and the sender carries on, so a
data plane never blocks on a slow control process (nor the control process on a slow data
plane).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct

from pd_router.wire import ChannelClosed, Message, WireError, decode, encode

HEADER = struct.Struct("!I")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


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
        data = encode(message)
        self._writer.write(HEADER.pack(len(data)) + data)

    async def receive(self) -> Message:
        """The next message; ChannelClosed at the end of the stream, and for bytes that are not
        a message of this protocol version."""
        try:
            head = await self._reader.readexactly(HEADER.size)
            (size,) = HEADER.unpack(head)
            if size > MAX_MESSAGE_BYTES:
                raise ChannelClosed(f"message of {size} bytes")
            return decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError, WireError) as exc:
            raise ChannelClosed(str(exc)) from None

    def close(self) -> None:
        self._writer.close()


class LocalChannel:
    """One end of a channel inside one process: what one end sends, the other receives, in
    order; nothing is encoded. Closing either end closes both (the other receives what was
    sent before, then ChannelClosed)."""

    def __init__(self) -> None:
        self._inbox: collections.deque[Message] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._peer: LocalChannel = self
        self._closed = False

    @classmethod
    def pair(cls) -> tuple[LocalChannel, LocalChannel]:
        """Two ends, each the other's peer."""
        one, other = cls(), cls()
        one._peer, other._peer = other, one
        return one, other

    @property
    def closed(self) -> bool:
        return self._closed

    def send(self, message: Message) -> None:
        """Hand ``message`` to the other end (dropped when the channel is closed)."""
        if self._closed:
            return
        peer = self._peer
        peer._inbox.append(message)
        peer._wake()

    async def receive(self) -> Message:
        """The next message; ChannelClosed once the channel is closed and nothing is left."""
        while not self._inbox:
            if self._closed:
                raise ChannelClosed("channel closed")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    def close(self) -> None:
        for end in (self, self._peer):
            end._closed = True
            end._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
