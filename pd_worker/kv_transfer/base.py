"""What every KV transport offers: register a local buffer, expose an endpoint, pull byte ranges.

A prefill registers its KV pool and hands out ``endpoint`` and the pool's pointer; a decode pulls
the byte ranges of a prompt's slots from there into its own pool. Buffers are raw addresses (a
torch tensor's ``data_ptr()`` or a ctypes buffer), so the transports never depend on torch.
"""

from __future__ import annotations

from typing import Protocol

# (remote_offset, local_offset, length) in bytes, relative to the two buffers' pointers.
ByteRange = tuple[int, int, int]


class KVTransferFailed(Exception):
    """A pull did not deliver every requested byte (peer gone, refused, stalled or out of range).

    ``message`` says which peer and why; the caller fails the request that needed the KV.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TransportUnavailable(RuntimeError):
    """The requested transport cannot run in this process (a library missing or failing to start).

    Raised instead of falling back to another transport, so a misconfigured worker fails at start
    with the reason rather than silently moving KV another way.
    """


class KVTransport(Protocol):
    """The data plane of the KV handoff, one instance per worker role."""

    kind: str

    def register(self, ptr: int, nbytes: int) -> None:
        """Make ``nbytes`` at ``ptr`` readable by peers (and a valid pull target)."""

    def unregister(self, ptr: int) -> None:
        """Stop serving the buffer registered at ``ptr`` (a role switch re-registers its pool)."""

    @property
    def endpoint(self) -> str:
        """What a peer passes to :meth:`pull` to reach this process's registered buffers."""

    async def pull(
        self, remote_endpoint: str, remote_ptr: int, local_ptr: int, ranges: list[ByteRange]
    ) -> None:
        """Copy each range of the peer's buffer at ``remote_ptr`` into ``local_ptr``.

        Raises :class:`KVTransferFailed` when any byte could not be delivered.
        """

    def close(self) -> None:
        """Stop serving and drop the registrations (a role switch builds a new transport)."""


def check_ranges(ranges: list[ByteRange]) -> int:
    """The total length of ``ranges``; negative offsets or lengths are the caller's bug."""
    for remote_offset, local_offset, length in ranges:
        if remote_offset < 0 or local_offset < 0 or length < 0:
            raise ValueError(f"invalid byte range {(remote_offset, local_offset, length)}")
    return sum(length for _, _, length in ranges)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` of a peer; a malformed endpoint fails the pull that was given it."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KVTransferFailed(f"malformed transfer endpoint {endpoint!r} (expected host:port)")
    return host, int(port)
