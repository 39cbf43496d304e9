"""A KV transfer peer in its own process: registers a patterned buffer and serves it.

``python -m tests.kv_transfer_peer KIND NBYTES`` prints one JSON line, ``{"endpoint", "ptr"}``,
then serves until its stdin closes (or it is killed, for the failure tests).
"""

from __future__ import annotations

import asyncio
import ctypes
import sys

import orjson

from pd_worker.kv_transfer import make_transport
from pd_worker.kv_transfer.base import KVTransport

LOOPBACK = "127.0.0.1"


def pattern(nbytes: int) -> bytes:
    """Bytes that differ at nearby offsets (251 is prime), so a shifted range never matches."""
    period = bytes(range(251))
    return (period * (nbytes // len(period) + 1))[:nbytes]


def patterned_buffer(nbytes: int) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(pattern(nbytes), nbytes)


async def serve(kind: str, nbytes: int) -> None:
    buffer = patterned_buffer(nbytes)
    transport: KVTransport = make_transport(kind, LOOPBACK)
    transport.register(ctypes.addressof(buffer), nbytes)
    sys.stdout.write(
        orjson.dumps({"endpoint": transport.endpoint, "ptr": ctypes.addressof(buffer)}).decode()
    )
    sys.stdout.write("\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.read)
    transport.close()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))
