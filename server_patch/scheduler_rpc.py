"""Calls into SGLang's scheduler from the HTTP process, over SGLang's own scheduler RPC.

The scheduler connects a socket to `port_args.rpc_ipc_name` and takes `RpcReqInput(method,
parameters)` from it (the socket `Engine.collective_rpc` binds; nothing binds it when SGLang
serves HTTP, so this module binds it on its first call), runs
`getattr(scheduler, method)(**parameters)` between batches on every TP rank and answers
`RpcReqOutput(success, message)`. The methods server_patch calls are the ones
`server_patch.scheduler_hooks` adds to the scheduler. `port_args` exists only inside SGLang's
launch: the launcher records it (`record_port_args`) as SGLang creates the tokenizer manager.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

# pyzmq comes with SGLang; the router's own venv, which imports server_patch too, may lack it.
if TYPE_CHECKING:
    import zmq.asyncio

DEFAULT_RPC_TIMEOUT_SECS = 30.0


class SchedulerRpcError(Exception):
    """The scheduler could not be asked, did not answer in time, or reported a failure."""


class SchedulerRpc:
    """One DEALER socket to the scheduler's RPC socket, one call at a time (a late answer to a
    call that timed out must not be read as the next call's: the socket is replaced then)."""

    def __init__(self, *, timeout_secs: float = DEFAULT_RPC_TIMEOUT_SECS) -> None:
        self._timeout_secs = timeout_secs
        self._endpoint: str | None = None
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()

    def record_port_args(self, port_args: Any) -> None:
        """Remember where the scheduler's RPC socket is (SGLang's `PortArgs.rpc_ipc_name`)."""
        self._endpoint = port_args.rpc_ipc_name

    async def call(self, method: str, **parameters: Any) -> None:
        """Run `method` on the scheduler; raises SchedulerRpcError unless it succeeded."""
        from sglang.srt.managers.io_struct import (
            RpcReqInput,
            RpcReqOutput,
            async_sock_recv,
            async_sock_send,
        )

        async with self._lock:
            socket = self._connect()
            try:
                await async_sock_send(socket, RpcReqInput(method=method, parameters=parameters))
                reply = await asyncio.wait_for(async_sock_recv(socket), self._timeout_secs)
            except TimeoutError:
                self._close()
                raise SchedulerRpcError(
                    f"the scheduler did not answer {method} within {self._timeout_secs:g}s"
                ) from None
        if not isinstance(reply, RpcReqOutput) or not reply.success:
            message = reply.message if isinstance(reply, RpcReqOutput) else repr(reply)
            raise SchedulerRpcError(f"{method} failed in the scheduler: {message}")

    def _connect(self) -> zmq.asyncio.Socket:
        import zmq
        import zmq.asyncio

        if self._endpoint is None:
            raise SchedulerRpcError("the scheduler's RPC socket is not known (server starting)")
        if self._socket is None:
            self._context = self._context or zmq.asyncio.Context()
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(self._endpoint)
        return self._socket

    def _close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
