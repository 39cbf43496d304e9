"""The torch data plane: a small real model over one preallocated KV pool, with a KV transport.

The model's weights and the pool tensor are built once per process and outlive every role
switch (the same ``data_ptr`` before and after, as SGLang keeps them under
``--enable-pd-role-switch``); the transport registration belongs to the role object and is torn
down and rebuilt with it, as ``role_switch.py`` rebuilds the transfer engine's registrations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from tokenizers import Tokenizer

from pd_worker.bootstrap import Room
from pd_worker.config import REGULAR_MODE, WorkerConfig
from pd_worker.data_plane import PlaneUnavailable, Role
from pd_worker.errors import BadRequest
from pd_worker.kv_transfer import KVTransport, TransportUnavailable, make_transport
from pd_worker.role_host import RoleHost
from pd_worker.torch_engine.config import DEFAULT_MODEL_CONFIG, ModelConfig
from pd_worker.torch_engine.kv_pool import KVPool
from pd_worker.torch_engine.model import DecodeSeq, ModelInputError, TorchModel
from pd_worker.torch_engine.tokenizer import build_tokenizer, decode, encode
from pd_worker.torch_roles import TorchDecodeRole, TorchPrefillRole, TorchRegularRole

T = TypeVar("T")


class TorchPlane:
    """Model, KV pool and tokenizer of one worker process, and the role objects that use them."""

    kind = "torch"

    def __init__(self, worker: WorkerConfig, capacity: int) -> None:
        """``capacity``: the token slots of the pool (the engine's KV capacity)."""
        config = ModelConfig.load(worker.model_config or DEFAULT_MODEL_CONFIG)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.pool = KVPool(config, capacity, device)
        self.model = TorchModel(config, self.pool, device)
        self.tokenizer: Tokenizer = build_tokenizer(config)
        self.transport_kind = worker.kv_transfer
        self._host = worker.host
        self._transport: KVTransport | None = None
        self._compute = asyncio.Lock()

    def make_role(self, host: RoleHost, role: str) -> Role:
        roles: dict[str, Callable[[RoleHost, TorchPlane], Role]] = {
            "prefill": TorchPrefillRole,
            "decode": TorchDecodeRole,
            REGULAR_MODE: TorchRegularRole,
        }
        return roles[role](host, self)

    async def before_send(self, room: Room) -> None:
        """Nothing to model: the decode reads the bytes itself after the payload names them."""

    async def after_teardown(self) -> None:
        """Nothing to model: the switch's work is real (the roles' teardown and build)."""

    def state(self) -> dict[str, Any]:
        return {
            "weights_data_ptr": self.model.weight_ptrs(),
            "kv_pool_data_ptr": self.pool.data_ptr,
            "free_slots": self.pool.free_slots,
            "transport": self.transport_kind,
        }

    def attach_transport(self) -> KVTransport:
        """The worker's transport with the pool registered on it, for a new role object. The
        transport itself lives as long as the process (created on first use): a role switch
        re-registers the pool, as SGLang's role switch rebuilds its transfer engine's
        registrations, but does not close the engine, which blocks a mooncake process for
        about a second."""
        try:
            if self._transport is None:
                self._transport = make_transport(self.transport_kind, self._host)
            self._transport.register(self.pool.data_ptr, self.pool.nbytes)
        except TransportUnavailable as exc:
            raise PlaneUnavailable(f"KV transport {self.transport_kind}: {exc}") from exc
        return self._transport

    def detach_transport(self) -> None:
        """The role object is torn down: peers can no longer read the pool through it."""
        if self._transport is not None:
            self._transport.unregister(self.pool.data_ptr)

    async def close(self) -> None:
        """The worker stops: close the transport (on a thread: a mooncake close blocks)."""
        transport, self._transport = self._transport, None
        if transport is not None:
            await asyncio.to_thread(transport.close)

    def check_fits(self, ids: list[int], new_tokens: int) -> None:
        """Refuse a prompt the model cannot run: ids outside its vocabulary, or more positions
        than it has (``new_tokens`` generated after the prompt)."""
        vocab = self.model.config.vocab_size
        if not ids:
            raise BadRequest("the torch engine needs a non-empty prompt")
        if any(not 0 <= token < vocab for token in ids):
            raise BadRequest(f"token ids must lie in [0, {vocab}) for this model")
        positions = len(ids) + max(new_tokens - 1, 0)
        if positions > self.model.config.max_position:
            raise BadRequest(
                f"{positions} positions exceed the model's max_position "
                f"{self.model.config.max_position}"
            )

    def tokenize(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def text(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids)

    async def prefill(self, ids: list[int], slots: list[int]) -> int:
        """Write the prompt's KV into ``slots``; the greedy first token."""
        try:
            return await self._compute_call(self.model.prefill, ids, slots)
        except ModelInputError as exc:
            raise BadRequest(str(exc)) from None

    async def decode_step(self, batch: list[DecodeSeq]) -> list[int]:
        """One decode step of every sequence in ``batch``; each one's next token."""
        return await self._compute_call(self.model.decode_step, batch)

    async def settled(self) -> None:
        """Wait until no forward is running (before freeing slots a forward may write)."""
        async with self._compute:
            return

    async def _compute_call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one forward in a thread (the event loop keeps serving transfers meanwhile), one
        at a time; a cancelled caller still waits for its forward to end, so the slots it
        writes are never freed under it."""
        async with self._compute:
            forward = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            try:
                return await asyncio.shield(forward)
            except asyncio.CancelledError:
                await asyncio.wait([forward])
                raise
