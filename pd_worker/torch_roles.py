"""Prefill and decode roles of the torch data plane.

The prefill computes a prompt's KV into slots of its pool, publishes where it lies (a
:class:`~pd_worker.kv_handoff.KVHandoff` as the room payload) and holds the slots until the decode
says it has read them. The decode learns the payload through the bootstrap server, pulls the
bytes into its own slots over the KV transport, then its sequence joins one batched decode loop
that steps every running sequence together. A regular server prefills into the decode's slots
itself and needs no transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from pd_worker.config import REGULAR_MODE
from pd_worker.errors import BadRequest, KVTransferError, RequestAborted
from pd_worker.kv_handoff import BadHandoff, KVHandoff, pair_runs
from pd_worker.kv_pull import KVPuller
from pd_worker.kv_transfer import KVTransferFailed, KVTransport
from pd_worker.requests import GenItem, Progress, Req
from pd_worker.role_host import RoleHost
from pd_worker.roles import apply_stop
from pd_worker.torch_engine.kv_pool import KVPool
from pd_worker.torch_engine.model import DecodeSeq

if TYPE_CHECKING:
    from pd_worker.bootstrap import Room

Emit = Callable[[Progress], None]
RELEASE_TIMEOUT_SECS = 5.0
# After a failed read the prefill is often gone: do not hold the failing request long for it.
FAILED_RELEASE_TIMEOUT_SECS = 0.5


class TorchCompute(Protocol):
    """What the torch roles need from the plane that builds them
    (:class:`~pd_worker.torch_plane.TorchPlane`): its pool, its transport and its forwards."""

    pool: KVPool

    def attach_transport(self) -> KVTransport:
        """The process's transport with the pool registered on it."""
        ...

    def detach_transport(self) -> None:
        """Unregister the pool: the role object is torn down."""
        ...

    def check_fits(self, ids: list[int], new_tokens: int) -> None:
        """Raise BadRequest for a prompt the model cannot run."""
        ...

    def text(self, ids: list[int]) -> str:
        """The text of generated token ids."""
        ...

    async def prefill(self, ids: list[int], slots: list[int]) -> int:
        """Write the prompt's KV into ``slots``; the first token."""
        ...

    async def decode_step(self, batch: list[DecodeSeq]) -> list[int]:
        """One decode step of every sequence; each one's next token."""
        ...

    async def settled(self) -> None:
        """Wait until no forward is running."""
        ...


class TorchPrefillRole:
    """Prefill: compute the prompt's KV, publish where it lies, hold it until it is read."""

    name = "prefill"

    def __init__(self, engine: RoleHost, plane: TorchCompute) -> None:
        self._engine = engine
        self._plane = plane
        self._transport: KVTransport | None = None
        self._queued: dict[str, int] = {}

    @property
    def queued_tokens(self) -> int:
        return sum(self._queued.values())

    def start(self) -> None:
        self._transport = self._plane.attach_transport()

    async def teardown(self) -> None:
        if self._transport is not None:
            self._transport = None
            self._plane.detach_transport()

    async def run(self, item: GenItem, req: Req, emit: Emit) -> None:
        engine = self._engine
        num_tokens = len(item.prompt_ids)
        engine.check_fits(num_tokens)
        self._plane.check_fits(item.prompt_ids, 1)
        room = None
        if not item.fake_transfer:
            if item.bootstrap_room in engine.rooms:
                raise BadRequest(f"bootstrap_room {item.bootstrap_room} is already in use")
            room = engine.rooms.open(item.bootstrap_room or 0, num_tokens)
        try:
            engine.set_stage(req, "waiting")
            await engine.kv_pool.acquire(num_tokens)
            try:
                first = await self._prefill_and_hold(item, req, room)
            finally:
                engine.kv_pool.release(num_tokens)
        finally:
            if room is not None:
                engine.rooms.close(room.room_id)
        emit(Progress([first], self._plane.text([first]), {"type": "length", "length": 0}))

    async def _prefill_and_hold(self, item: GenItem, req: Req, room: Room | None) -> int:
        """Prefill into fresh slots; with a room, hold them until the decode has read them."""
        slots = self._plane.pool.alloc(len(item.prompt_ids))
        try:
            first = await self._forward(item, req, slots)
            if room is not None:
                self._engine.set_stage(req, "inflight")
                room.payload.set_result(self._handoff(slots, first).encode())
                await self._wait_released(item, room.released)
            return first
        finally:
            await self._plane.settled()
            self._plane.pool.free(slots)

    async def _forward(self, item: GenItem, req: Req, slots: list[int]) -> int:
        self._queued[item.rid] = len(item.prompt_ids)
        try:
            first = await self._plane.prefill(item.prompt_ids, slots)
        finally:
            self._queued.pop(item.rid, None)
        self._engine.set_stage(req, "running")
        self._engine.stats.count_prefill(len(item.prompt_ids), 0)
        return first

    def _handoff(self, slots: list[int], first: int) -> KVHandoff:
        if self._transport is None:
            raise RequestAborted("the prefill has no KV transport (role torn down)")
        pool = self._plane.pool
        return KVHandoff(
            self._transport.kind,
            self._transport.endpoint,
            pool.data_ptr,
            pool.byte_ranges(slots),
            first,
            len(slots),
        )

    async def _wait_released(self, item: GenItem, released: asyncio.Future[None]) -> None:
        """Hold the slots until the decode has read them, at most the room timeout."""
        try:
            async with asyncio.timeout(self._engine.timing.room_timeout_secs):
                await released
        except TimeoutError:
            self._engine.stats.num_bootstrap_failed_reqs += 1
            raise RequestAborted(
                f"Prefill bootstrap failed for request req.rid={item.rid!r} "
                f"req.bootstrap_room={item.bootstrap_room}: the decode did not read the KV"
            ) from None


class StepFailed(RequestAborted):
    """A decode step raised: every sequence of that step fails with it, the loop goes on."""


@dataclass
class Running:
    """A sequence in the decode loop: its reserved slots, how many hold KV, its last token."""

    slots: list[int]
    context: int
    last_token: int
    budget: int
    # Each step's token, or the error that ended the step.
    tokens: asyncio.Queue[int | StepFailed] = field(default_factory=asyncio.Queue)


class DecodeLoop:
    """One batched decode loop: every step advances every running sequence by one token."""

    def __init__(self, plane: TorchCompute) -> None:
        self._plane = plane
        self._running: list[Running] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def join(self, seq: Running) -> None:
        self._running.append(seq)
        self._wakeup.set()

    async def leave(self, seq: Running) -> None:
        """Take ``seq`` out; returns once no step writes its slots any more."""
        if seq in self._running:
            self._running.remove(seq)
        await self._plane.settled()

    async def _loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._running:
                batch = list(self._running)
                inputs = [
                    DecodeSeq(s.slots[: s.context], s.last_token, s.slots[s.context]) for s in batch
                ]
                try:
                    tokens = await self._plane.decode_step(inputs)
                except (ValueError, RuntimeError) as exc:
                    self._fail(batch, StepFailed(f"decode step failed: {exc}"))
                    continue
                for seq, token in zip(batch, tokens, strict=True):
                    seq.context += 1
                    seq.last_token = token
                    seq.budget -= 1
                    seq.tokens.put_nowait(token)
                    if seq.budget == 0 and seq in self._running:
                        self._running.remove(seq)

    def _fail(self, batch: list[Running], error: StepFailed) -> None:
        for seq in batch:
            if seq in self._running:
                self._running.remove(seq)
            seq.tokens.put_nowait(error)


class TorchDecodeRole:
    """Decode: reserve slots, pull the prompt's KV into them, generate in the batched loop."""

    name = "decode"
    queued_tokens = 0
    # The queue a request enters while its KV is reserved and received.
    admit_stage = "prealloc"

    def __init__(self, engine: RoleHost, plane: TorchCompute) -> None:
        self._engine = engine
        self._plane = plane
        self._puller = KVPuller()
        self._loop = DecodeLoop(plane)
        self._transport: KVTransport | None = None

    def start(self) -> None:
        self._transport = self._plane.attach_transport()
        self._loop.start()

    async def teardown(self) -> None:
        await self._loop.stop()
        self._puller.close()
        if self._transport is not None:
            self._transport = None
            self._plane.detach_transport()

    async def run(self, item: GenItem, req: Req, emit: Emit) -> None:
        engine = self._engine
        num_tokens = len(item.prompt_ids)
        reserve = num_tokens + item.max_new_tokens
        engine.check_fits(reserve)
        self._plane.check_fits(item.prompt_ids, item.max_new_tokens)
        engine.set_stage(req, self.admit_stage)
        await engine.kv_pool.acquire(reserve)
        try:
            slots = self._plane.pool.alloc(reserve)
            try:
                first, source = await self._receive(item, req, slots[:num_tokens])
                engine.set_stage(req, "waiting")
                async with engine.running_slots:
                    engine.set_stage(req, "running")
                    seq = Running(slots, num_tokens, first, item.max_new_tokens - 1)
                    await self._generate(item, seq, source, emit)
            finally:
                await self._plane.settled()
                self._plane.pool.free(slots)
        finally:
            engine.kv_pool.release(reserve)

    async def _receive(self, item: GenItem, req: Req, slots: list[int]) -> tuple[int, str | None]:
        """The prompt's KV in ``slots``; the prefill's first token and url (a fake transfer, as
        a health check sends, prefills locally instead)."""
        if item.fake_transfer:
            return await self._plane.prefill(item.prompt_ids, slots), None
        self._engine.set_stage(req, "transfer")
        host, port, room = item.bootstrap_host or "", item.bootstrap_port or 0, item.bootstrap_room
        room_id = room or 0
        timeout = self._engine.timing.bootstrap_timeout_secs
        started = time.monotonic()
        pulled = None
        try:
            pulled = await self._puller.pull(host, port, room_id, timeout)
            handoff = KVHandoff.decode(pulled.payload)
            if handoff.num_tokens != len(slots):
                raise BadHandoff(f"{handoff.num_tokens} KV tokens for a {len(slots)}-token prompt")
            await self._read_kv(handoff, slots, pulled.source)
        except (KVTransferError, KVTransferFailed, BadHandoff) as exc:
            self._engine.stats.num_bootstrap_failed_reqs += 1
            if pulled is not None:
                await self._release(host, port, room_id, FAILED_RELEASE_TIMEOUT_SECS)
            raise RequestAborted(
                f"KV transfer failed for request rid={item.rid!r} bootstrap_room={room}: {exc}"
            ) from None
        await self._release(host, port, room_id, RELEASE_TIMEOUT_SECS)
        nbytes = sum(length for _, length in handoff.ranges)
        self._engine.stats.count_transfer(nbytes, time.monotonic() - started)
        return handoff.first_token, pulled.source

    async def _release(self, host: str, port: int, room_id: int, timeout_secs: float) -> None:
        """Let the prefill free the room's slots (it frees them at its room timeout when it
        cannot be told)."""
        with contextlib.suppress(KVTransferError):
            await self._puller.release(host, port, room_id, timeout_secs)

    async def _read_kv(self, handoff: KVHandoff, slots: list[int], source: str | None) -> None:
        if self._transport is None:
            raise KVTransferFailed("the decode has no KV transport (role torn down)")
        if handoff.transport != self._transport.kind:
            raise KVTransferFailed(
                f"the prefill {source} moves KV over {handoff.transport} but this decode over "
                f"{self._transport.kind}: start every worker with the same --kv-transfer"
            )
        pool = self._plane.pool
        transfers = pair_runs(handoff.ranges, pool.byte_ranges(slots))
        await self._transport.pull(handoff.endpoint, handoff.pool_ptr, pool.data_ptr, transfers)

    async def _generate(self, item: GenItem, seq: Running, source: str | None, emit: Emit) -> None:
        """Stream the first token, then one token per step of the shared decode loop."""
        if item.max_new_tokens == 0:
            emit(Progress([], "", {"type": "length", "length": 0}, source))
            return
        ids = [seq.last_token]
        if self._emit(item, ids, source, emit) or seq.budget <= 0:
            return
        self._loop.join(seq)
        try:
            while True:
                token = await seq.tokens.get()
                if isinstance(token, StepFailed):
                    raise token
                ids.append(token)
                if self._emit(item, ids, source, emit):
                    return
        finally:
            await self._loop.leave(seq)

    def _emit(self, item: GenItem, ids: list[int], source: str | None, emit: Emit) -> bool:
        """Emit the progress after the newest token; whether the sequence has finished."""
        self._engine.stats.count_generated(1)
        token = ids[-1]
        text = self._plane.text(ids)
        finish: dict[str, object] | None = None
        if token in item.stop_token_ids:
            finish = {"type": "stop", "matched": token}
        else:
            text, finish = apply_stop(text, item.stop)
        if finish is None and len(ids) >= item.max_new_tokens:
            finish = {"type": "length", "length": item.max_new_tokens}
        emit(Progress(list(ids), text, finish, source))
        return finish is not None


class TorchRegularRole(TorchDecodeRole):
    """A regular (non-disaggregated) server: the prompt is prefilled into the slots the decode
    reserved, then generated in the batched loop; bootstrap fields are ignored, no KV moves and
    no transport is registered."""

    name = REGULAR_MODE
    admit_stage = "waiting"

    def start(self) -> None:
        self._loop.start()

    async def _receive(self, item: GenItem, req: Req, slots: list[int]) -> tuple[int, str | None]:
        self._engine.set_stage(req, "running")
        first = await self._plane.prefill(item.prompt_ids, slots)
        self._engine.stats.count_prefill(len(item.prompt_ids), 0)
        return first, None
