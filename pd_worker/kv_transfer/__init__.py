"""KV handoff data plane: a prefill registers its pool, a decode pulls byte ranges of it.

Two transports behind one :class:`KVTransport` protocol: mooncake's TransferEngine over TCP (the
default, as SGLang's mooncake backend) and a plain asyncio TCP server (the explicit fallback).
"""

from pd_worker.kv_transfer.base import (
    ByteRange,
    KVTransferFailed,
    KVTransport,
    TransportUnavailable,
)
from pd_worker.kv_transfer.factory import TRANSPORTS, make_transport
from pd_worker.kv_transfer.mooncake import MooncakeTransport
from pd_worker.kv_transfer.tcp import TcpTransport

__all__ = [
    "TRANSPORTS",
    "ByteRange",
    "KVTransferFailed",
    "KVTransport",
    "MooncakeTransport",
    "TcpTransport",
    "TransportUnavailable",
    "make_transport",
]
