"""KV pulls over mooncake's TransferEngine with its TCP protocol, as SGLang's mooncake backend.

Each transport owns one TransferEngine in P2P-handshake mode (no metadata server): its endpoint
is ``host:rpc_port``, the session id a peer passes to the engine's reads. Opening a peer's
segment (its handshake) and waiting for transfers block, so pulls run on the transport's own
threads, never on the event loop. A stalled peer is bounded by the engine's TCP progress
timeout (``MC_TCP_PROGRESS_TIMEOUT_SEC``), a dead one fails at once with connection refused.

The engine (0.3.13) binds its handshake and data listeners to every interface whatever ``host``
is; ``host`` is only what the endpoint advertises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
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
PROGRESS_TIMEOUT_SECS = 5
PULL_THREADS = 2
POLL_SECS = 0.0002
# transfer_check_status: 1 done, 0 in flight, -1 failed, -2 timed out.
DONE = 1
IN_FLIGHT = 0
FAILURES = {
    -1: "the transfer failed (peer gone, stalled past the progress timeout, or range not "
    "registered)",
    -2: "the transfer timed out",
}
# What the engine logs at ERROR level while initializing although nothing failed: the lookup of
# its own segment before anything is registered.
BENIGN_INIT_ERROR = "Local segment descriptor not found"

log = logging.getLogger("pd_worker.kv_transfer")

# batch_transfer_async_read's batch id when it could not open the peer or submit the batch.
SUBMIT_FAILED = (0, (1 << 64) - 1)


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

    def __init__(self, host: str) -> None:
        engine_class = load_transfer_engine()
        # The engine reads its timeouts from the environment only, once per process: an
        # operator's value wins, else a stalled peer fails a pull after this many seconds.
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(PROGRESS_TIMEOUT_SECS))
        engine = engine_class()
        with _native_stderr_filtered():
            status = engine.initialize(host, P2P_HANDSHAKE, PROTOCOL, "")
        if status != 0:
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
        """Every range read by the engine on the transport's threads (see :func:`read_ranges`).

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
            read_ranges,
            self._engine,
            remote_endpoint,
            [
                (local_ptr + local_offset, remote_ptr + remote_offset, length)
                for remote_offset, local_offset, length in ranges
            ],
        )
        failure = await _finish_before_cancel(read)
        if failure is not None:
            raise KVTransferFailed(
                f"mooncake read of {total} bytes in {len(ranges)} ranges from {remote_endpoint} "
                f"failed: {failure}"
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


@contextlib.contextmanager
def _native_stderr_filtered() -> Iterator[None]:
    """Hold what the engine's C++ logging writes to stderr (file descriptor 2) inside the block,
    then pass it on without its benign ERROR line, which goes to this module's debug log."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
    for line in lines:
        if BENIGN_INIT_ERROR in line:
            log.debug("mooncake: %s", line.strip())
        else:
            sys.stderr.write(line)
    sys.stderr.flush()


def read_ranges(engine: Any, endpoint: str, copies: list[tuple[int, int, int]]) -> str | None:
    """Read each (local address, remote address, length) from ``endpoint``; runs on a pull thread.

    Each range is its own asynchronous engine batch, and this thread sleeps between status polls:
    the engine's synchronous reads spin on the status instead, which on a small machine takes a
    core from the engine's own socket threads (about a third less bandwidth on 2 cores). Returns
    once no batch is in flight, so nothing writes into the local buffer afterwards: ``None`` if
    every range arrived, else why not.
    """
    failure = None
    pending = []
    for local, remote, length in copies:
        batch = engine.batch_transfer_async_read(endpoint, [local], [remote], [length])
        if batch in SUBMIT_FAILED:
            failure = "the engine could not submit it (peer unreachable or gone)"
            break
        pending.append(batch)
    while pending:
        time.sleep(POLL_SECS)
        still = []
        for batch in pending:
            status = engine.transfer_check_status(batch)
            if status == IN_FLIGHT:
                still.append(batch)
            elif status != DONE and failure is None:
                failure = FAILURES.get(status, f"engine status {status}")
        pending = still
    return failure


async def _finish_before_cancel(read: asyncio.Future[str | None]) -> str | None:
    """The read's status; a cancelled caller still waits for the engine to stop writing into its
    buffer, so that it can hand the destination slots to someone else right away."""
    try:
        return await asyncio.shield(read)
    except asyncio.CancelledError:
        await asyncio.wait({read})
        raise
