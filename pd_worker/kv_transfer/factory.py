"""The one place a transport kind becomes a transport: an explicit choice, never a fallback."""

from __future__ import annotations

from pd_worker.kv_transfer.base import KVTransport
from pd_worker.kv_transfer.mooncake import MooncakeTransport
from pd_worker.kv_transfer.tcp import TcpTransport

TRANSPORTS = ("mooncake", "tcp")


def make_transport(kind: str, host: str) -> KVTransport:
    """The transport ``kind`` bound to ``host``.

    An unusable mooncake raises :class:`TransportUnavailable` with the reason instead of
    returning the TCP transport: which path the KV takes is the operator's choice.
    """
    if kind == "mooncake":
        return MooncakeTransport(host)
    if kind == "tcp":
        return TcpTransport(host)
    raise ValueError(f"unknown KV transport {kind!r}; expected one of {', '.join(TRANSPORTS)}")
