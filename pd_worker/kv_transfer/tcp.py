"""The plain-TCP fallback: an asyncio server that serves reads of the registered buffers.

Chosen explicitly (``--kv-transfer tcp``), never as a silent substitute for mooncake. A pull is
one connection carrying one request, the absolute addresses and lengths of its ranges; the server
checks that every range lies inside one registered buffer, then answers a status and the bytes in
request order. The client copies each chunk into the local buffer with ``ctypes.memmove``. Every
step waits at most ``progress_timeout_secs``, so a dead or stalled peer fails the pull instead of
hanging it.
"""

from __future__ import annotations

import asyncio
import ctypes
import socket
import struct

from pd_worker.kv_transfer.base import (
    ByteRange,
    KVTransferFailed,
    TransportUnavailable,
    check_ranges,
    split_endpoint,
)

COUNT = struct.Struct("!I")  # number of ranges in a request
RANGE = struct.Struct("!QQ")  # absolute address, length
STATUS = struct.Struct("!BI")  # 0 = bytes follow, else an error of that many message bytes
OK = 0
REFUSED = 1
CHUNK_BYTES = 1 << 20
MAX_RANGES = 1 << 20
DEFAULT_PROGRESS_TIMEOUT_SECS = 5.0


class TcpTransport:
    """Serves this process's registered buffers on ``host`` and pulls from peers' over TCP."""

    kind = "tcp"

    def __init__(
        self, host: str, *, progress_timeout_secs: float = DEFAULT_PROGRESS_TIMEOUT_SECS
    ) -> None:
        try:
            self._sock = socket.create_server((host, 0))
        except OSError as exc:
            raise TransportUnavailable(f"tcp transport cannot listen on {host}: {exc}") from exc
        self._sock.setblocking(False)
        self._endpoint = f"{host}:{self._sock.getsockname()[1]}"
        self._timeout = progress_timeout_secs
        self._buffers: dict[int, int] = {}
        self._serving: asyncio.Task[asyncio.Server] | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._closed = False

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, ptr: int, nbytes: int) -> None:
        """Serve reads of ``nbytes`` at ``ptr``; called on the event loop, which then serves.

        The socket already listens (the endpoint is fixed at construction), so peers connecting
        before the server task first runs wait in the backlog.
        """
        if self._closed:
            raise TransportUnavailable(f"tcp transport {self._endpoint} is closed")
        self._buffers[ptr] = nbytes
        if self._serving is None:
            self._serving = asyncio.get_running_loop().create_task(
                asyncio.start_server(self._serve, sock=self._sock)
            )

    def unregister(self, ptr: int) -> None:
        """Stop serving the buffer at ``ptr`` (later requests for it are refused)."""
        self._buffers.pop(ptr, None)

    async def pull(
        self, remote_endpoint: str, remote_ptr: int, local_ptr: int, ranges: list[ByteRange]
    ) -> None:
        """Fetch every range from the peer in one request on a fresh connection."""
        total = check_ranges(ranges)
        if not ranges:
            return
        host, port = split_endpoint(remote_endpoint)
        try:
            await self._pull(host, port, remote_ptr, local_ptr, ranges)
        except KVTransferFailed:
            raise
        except TimeoutError as exc:
            raise KVTransferFailed(
                f"tcp pull of {total} bytes from {remote_endpoint}: no progress within "
                f"{self._timeout:g} s"
            ) from exc
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise KVTransferFailed(
                f"tcp pull of {total} bytes from {remote_endpoint} failed: {exc!r}"
            ) from exc

    async def _pull(
        self, host: str, port: int, remote_ptr: int, local_ptr: int, ranges: list[ByteRange]
    ) -> None:
        async with asyncio.timeout(self._timeout):
            reader, writer = await asyncio.open_connection(host, port)
        try:
            request = [COUNT.pack(len(ranges))]
            request += [RANGE.pack(remote_ptr + offset, length) for offset, _, length in ranges]
            writer.write(b"".join(request))
            async with asyncio.timeout(self._timeout):
                status, size = STATUS.unpack(await reader.readexactly(STATUS.size))
                if status != OK:
                    message = (await reader.readexactly(size)).decode(errors="replace")
                    raise KVTransferFailed(f"tcp pull from {host}:{port} refused: {message}")
            for _, local_offset, length in ranges:
                await self._receive(reader, local_ptr + local_offset, length)
        finally:
            writer.close()

    async def _receive(self, reader: asyncio.StreamReader, address: int, length: int) -> None:
        done = 0
        while done < length:
            async with asyncio.timeout(self._timeout):
                chunk = await reader.readexactly(min(CHUNK_BYTES, length - done))
            ctypes.memmove(address + done, chunk, len(chunk))
            done += len(chunk)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer requests on one connection until the peer closes it."""
        self._connections.add(writer)
        try:
            while header := await reader.read(COUNT.size):
                if len(header) < COUNT.size:
                    header += await reader.readexactly(COUNT.size - len(header))
                (count,) = COUNT.unpack(header)
                if count > MAX_RANGES:
                    await self._refuse(writer, f"{count} ranges in one request")
                    return
                body = await reader.readexactly(count * RANGE.size)
                wanted = [RANGE.unpack_from(body, i * RANGE.size) for i in range(count)]
                stray = next((r for r in wanted if not self._is_registered(*r)), None)
                if stray is not None:
                    await self._refuse(writer, f"range {stray[0]:#x}+{stray[1]} not registered")
                    return
                writer.write(STATUS.pack(OK, 0))
                for address, length in wanted:
                    await self._send(writer, address, length)
        except (OSError, asyncio.IncompleteReadError):
            return
        finally:
            self._connections.discard(writer)
            writer.close()

    def _is_registered(self, address: int, length: int) -> bool:
        return any(
            ptr <= address and address + length <= ptr + nbytes
            for ptr, nbytes in self._buffers.items()
        )

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, address: int, length: int) -> None:
        for start in range(address, address + length, CHUNK_BYTES):
            size = min(CHUNK_BYTES, address + length - start)
            writer.write(memoryview((ctypes.c_char * size).from_address(start)).cast("B"))
            await writer.drain()

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, message: str) -> None:
        encoded = message.encode()
        writer.write(STATUS.pack(REFUSED, len(encoded)) + encoded)
        await writer.drain()

    def close(self) -> None:
        """Stop serving, drop open connections and the registrations."""
        self._closed = True
        self._buffers.clear()
        for writer in self._connections:
            writer.close()
        self._connections.clear()
        if self._serving is None:
            self._sock.close()
        elif self._serving.done():
            self._stop_serving(self._serving)
        else:
            self._serving.add_done_callback(self._stop_serving)

    def _stop_serving(self, serving: asyncio.Task[asyncio.Server]) -> None:
        """Close the server once started (it owns the socket then), else the bare socket."""
        if serving.cancelled() or serving.exception() is not None:
            self._sock.close()
        else:
            serving.result().close()
