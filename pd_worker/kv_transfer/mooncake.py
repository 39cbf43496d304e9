"""KV pulls over mooncake's TransferEngine with its TCP protocol, as SGLang's mooncake backend.

Each transport owns one TransferEngine in P2P-handshake mode (no metadata server): its endpoint
is ``host:rpc_port``, the session id a peer passes to the engine's reads. The engine's transfer
calls block (they poll the transfer status until done), so every one runs on the transport's own
threads, never on the event loop. A stalled peer is bounded by the engine's TCP progress timeout
(``MC_TCP_PROGRESS_TIMEOUT_SEC``), a dead one fails at once with connection refused.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pd_worker.kv_transfer.base import (
    ByteRange,
    KVTransferFailed,
    TransportUnavailable,
    check_ranges,
)

PROTOCOL = "tcp"
P2P_HANDSHAKE = "P2PHANDSHAKE"
DEFAULT_PROGRESS_TIMEOUT_SECS = 5
PULL_THREADS = 2


def load_transfer_engine() -> type[Any]:
    """mooncake's ``TransferEngine`` class, or :class:`TransportUnavailable` saying why not.

    The wheel links against libibverbs, librdmacm and libnuma even for TCP; a machine without
    them fails here (``make test`` installs them with the other test tools).
    """
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportUnavailable(
            f"mooncake transfer engine cannot be imported ({exc}); install the 'torch' extra "
            "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1 librdmacm1 libnuma1, "
            "or choose the tcp transport explicitly"
        ) from exc
    return TransferEngine


class MooncakeTransport:
    """A mooncake TransferEngine serving this process's registered buffers and pulling peers'."""

    kind = "mooncake"

    def __init__(
        self, host: str, *, progress_timeout_secs: int = DEFAULT_PROGRESS_TIMEOUT_SECS
    ) -> None:
        engine_class = load_transfer_engine()
        # The engine reads its timeouts from the environment only; an operator's value wins.
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(progress_timeout_secs))
        engine = engine_class()
        if engine.initialize(host, P2P_HANDSHAKE, PROTOCOL, "") != 0:
            raise TransportUnavailable(
                f"mooncake transfer engine failed to initialize on {host} ({PROTOCOL})"
            )
        self._engine: Any = engine
        self._endpoint = f"{host}:{engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._executor = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="mooncake-pull")

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` at ``ptr`` with the engine (over TCP: bookkeeping, no pinning)."""
        if self._engine is None:
            raise TransportUnavailable(f"mooncake transport {self._endpoint} is closed")
        if self._engine.register_memory(ptr, nbytes) != 0:
            raise TransportUnavailable(f"mooncake refused to register {nbytes} bytes at {ptr:#x}")
        self._registered.append(ptr)

    async def pull(
        self, remote_endpoint: str, remote_ptr: int, local_ptr: int, ranges: list[ByteRange]
    ) -> None:
        """One batched engine read of every range, run on the transport's threads.

        Cancelling the caller waits for the read to end first: the engine writes into
        ``local_ptr`` until then.
        """
        total = check_ranges(ranges)
        if not ranges:
            return
        if self._engine is None:
            raise KVTransferFailed(f"mooncake transport {self._endpoint} is closed")
        read = asyncio.get_running_loop().run_in_executor(
            self._executor,
            self._engine.batch_transfer_sync_read,
            remote_endpoint,
            [local_ptr + local_offset for _, local_offset, _ in ranges],
            [remote_ptr + remote_offset for remote_offset, _, _ in ranges],
            [length for _, _, length in ranges],
        )
        rc = await _finish_before_cancel(read)
        if rc != 0:
            raise KVTransferFailed(
                f"mooncake read of {total} bytes in {len(ranges)} ranges from {remote_endpoint} "
                f"failed (engine status {rc}: peer unreachable, stalled or range not registered)"
            )

    def unregister(self, ptr: int) -> None:
        """Stop serving the buffer at ``ptr``; the engine stays up for the next registration."""
        if self._engine is not None and ptr in self._registered:
            self._engine.unregister_memory(ptr)
            self._registered.remove(ptr)

    def close(self) -> None:
        """Unregister every buffer and destroy the engine.

        The engine's teardown holds the GIL for about a second (its listener threads stop), so a
        role switch that keeps the process re-registers with :meth:`unregister` and
        :meth:`register` instead of closing.
        """
        if self._engine is None:
            return
        for ptr in list(self._registered):
            self.unregister(ptr)
        self._engine = None
        self._executor.shutdown(wait=False)


async def _finish_before_cancel(read: asyncio.Future[int]) -> int:
    """The read's status; a cancelled caller still waits for the engine to stop writing into its
    buffer, so that it can hand the destination slots to someone else right away."""
    try:
        return await asyncio.shield(read)
    except asyncio.CancelledError:
        await asyncio.wait({read})
        raise
