"""The role-specific halves of a worker, torn down and rebuilt on every role switch.

A role object owns what SGLang's ``init_disaggregation`` builds for one mode (the prefill
batcher and its rooms, the decode's transfer path, or both halves in one process for a regular
server). The :class:`~pd_worker.engine.Engine`,
its KV pool and its bootstrap listener outlive it; a role sees it as a
:class:`~pd_worker.role_host.RoleHost`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable

from pd_worker.config import REGULAR_MODE
from pd_worker.errors import BadRequest, KVTransferError, RequestAborted
from pd_worker.kv_pull import KVPuller, PulledKV, lost_pull
from pd_worker.requests import GenItem, Progress, Req, token_logprob
from pd_worker.role_host import RoleHost
from pd_worker.tokens import WORDS, detokenize, output_ids_from_payload, pack_prompt

Emit = Callable[[Progress], None]
# A prompt waiting for a prefill forward: its request, its token ids, and the future that gets
# how many of its tokens the prefix cache served once the forward is done.
# A request waiting for its forward: its prompt, the tokens of it the cache did not hold when
# it was queued, and the future the forward resolves with the tokens the cache served.
Pending = tuple[Req, list[int], int, asyncio.Future[int]]


class PrefillRole:
    """Prefill: batch forwards under a token budget, then hold the KV until a decode pulls it.

    A prompt's cached prefix is looked up when its batch forms (as SGLang's scheduler matches
    the radix cache for each new prefill batch), so a prompt that waited behind the one that
    cached its prefix reuses it; only the uncached tokens cost forward time and budget."""

    name = "prefill"

    def __init__(self, engine: RoleHost) -> None:
        self._engine = engine
        self._pending: collections.deque[Pending] = collections.deque()
        self._wakeup = asyncio.Event()
        self._batcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._batcher = asyncio.create_task(self._batch_loop())

    async def teardown(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batcher

    @property
    def queued_tokens(self) -> int:
        """Uncached prompt tokens waiting for a forward (SGLang's
        ``num_waiting_uncached_tokens``), as the cache stood when each was queued."""
        return sum(uncached for _, _, uncached, future in self._pending if not future.done())

    async def run(self, item: GenItem, req: Req, emit: Emit) -> None:
        engine = self._engine
        num_tokens = len(item.prompt_ids)
        engine.check_fits(num_tokens)
        room = None
        deadline = time.monotonic() + engine.timing.room_timeout_secs
        if not item.fake_transfer:
            if item.bootstrap_room in engine.rooms:
                raise BadRequest(f"bootstrap_room {item.bootstrap_room} is already in use")
            room = engine.rooms.open(item.bootstrap_room or 0, num_tokens)
        try:
            engine.set_stage(req, "waiting")
            await engine.kv_pool.acquire(num_tokens)
            try:
                cached = await self.forward(req, item.prompt_ids)
                payload = pack_prompt(item.prompt_ids)
                if room is not None:
                    room.cached_tokens = cached
                    engine.set_stage(req, "inflight")
                    room.payload.set_result(payload)
                    await self._wait_pulled(item, room.pulled, deadline)
            finally:
                engine.kv_pool.release(num_tokens)
        finally:
            if room is not None:
                engine.rooms.close(room.room_id)
        first = output_ids_from_payload(payload, 1)
        progress = Progress(first, detokenize(first), {"type": "length", "length": 0})
        progress.cached_tokens = cached
        if item.return_logprob:
            progress.input_token_logprobs = _input_logprobs(item.prompt_ids)
            progress.output_token_logprobs = []
        emit(progress)

    async def _wait_pulled(
        self, item: GenItem, pulled: asyncio.Future[None], deadline: float
    ) -> None:
        """Hold the KV until the decode pulled it; free the room after the room timeout."""
        started = time.monotonic()
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                await pulled
        except TimeoutError:
            self._engine.stats.num_bootstrap_failed_reqs += 1
            elapsed = time.monotonic() - started
            error = KVTransferError(
                item.bootstrap_room or 0,
                f"Request {item.bootstrap_room} timed out after {elapsed:.1f}s "
                "in KVPoll.Bootstrapping",
            )
            raise RequestAborted(
                f"Prefill bootstrap failed for request rank=0 req.rid={item.rid!r} "
                f"req.bootstrap_room={item.bootstrap_room} with exception {error}"
            ) from None

    async def forward(self, req: Req, prompt_ids: list[int]) -> int:
        """Wait for the forward that prefills ``prompt_ids``; the tokens the cache served."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        uncached = len(prompt_ids) - self._engine.prefix_cache.peek(prompt_ids)
        self._pending.append((req, prompt_ids, uncached, future))
        self._wakeup.set()
        return await future

    async def _batch_loop(self) -> None:
        """One simulated GPU: forwards run one batch at a time, each under the token budget."""
        timing = self._engine.timing
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._pending:
                batch, hits, tokens = self._take_batch()
                for queued, _, _, _ in batch:
                    self._engine.set_stage(queued, "running")
                started = time.monotonic()
                await timing.wait(timing.prefill_secs(tokens))
                busy_us = round((time.monotonic() - started) * 1e6)
                self._engine.stats.count_prefill_forward(tokens, busy_us)
                self._finish_batch(batch, hits)

    def _take_batch(self) -> tuple[list[Pending], list[int], int]:
        """The next batch, the cached tokens of each of its prompts, and its uncached tokens
        (what the forward computes, bounded by ``max_prefill_tokens``)."""
        timing = self._engine.timing
        cache = self._engine.prefix_cache
        batch: list[Pending] = []
        hits: list[int] = []
        tokens = 0
        while self._pending and len(batch) < timing.max_running_requests:
            _, prompt_ids, _, future = self._pending[0]
            if future.done():
                self._pending.popleft()
                continue
            cached = cache.match(prompt_ids)
            uncached = len(prompt_ids) - cached
            if batch and tokens + uncached > timing.max_prefill_tokens:
                break
            batch.append(self._pending.popleft())
            hits.append(cached)
            tokens += uncached
        return batch, hits, tokens

    def _finish_batch(self, batch: list[Pending], hits: list[int]) -> None:
        """Cache the prompts just prefilled and wake their requests."""
        engine = self._engine
        for (_, prompt_ids, _, future), cached in zip(batch, hits, strict=True):
            if future.done():
                continue
            engine.prefix_cache.insert(prompt_ids)
            engine.stats.count_prefill(len(prompt_ids), cached)
            future.set_result(cached)


class DecodeRole:
    """Decode: reserve KV, pull it from the prefill's bootstrap server, then generate tokens."""

    name = "decode"
    # The queue a request enters while its KV is reserved and received.
    admit_stage = "prealloc"

    def __init__(self, engine: RoleHost) -> None:
        self._engine = engine
        self._puller = KVPuller()
        self._context_tokens = 0

    @property
    def queued_tokens(self) -> int:
        """A decode runs no prefill forwards, so no prompt tokens ever wait for one."""
        return 0

    def start(self) -> None:
        """Nothing to start: decode work runs inside each request."""

    async def teardown(self) -> None:
        """Close the pooled bootstrap connections (a role switch needs an idle decode)."""
        self._puller.close()

    async def run(self, item: GenItem, req: Req, emit: Emit) -> None:
        engine = self._engine
        reserve = len(item.prompt_ids) + item.max_new_tokens
        engine.check_fits(reserve)
        engine.set_stage(req, self.admit_stage)
        await engine.kv_pool.acquire(reserve)
        try:
            pulled = await self._receive(item, req)
            engine.set_stage(req, "waiting")
            async with engine.running_slots:
                engine.set_stage(req, "running")
                await self._decode(item, pulled, emit)
        finally:
            engine.kv_pool.release(reserve)

    async def _receive(self, item: GenItem, req: Req) -> PulledKV:
        """The KV payload (from the prefill, or the decode's own prompt for a fake transfer)."""
        if item.fake_transfer:
            return PulledKV(pack_prompt(item.prompt_ids), None)
        engine = self._engine
        engine.set_stage(req, "transfer")
        started = time.monotonic()
        host, port, room = item.bootstrap_host or "", item.bootstrap_port or 0, item.bootstrap_room
        timeout = engine.timing.bootstrap_timeout_secs
        try:
            if engine.faults.stale_bootstrap == f"{host}:{port}":
                pulled = await lost_pull(room or 0, timeout)
            else:
                pulled = await self._puller.pull(host, port, room or 0, timeout)
        except KVTransferError as exc:
            engine.stats.num_bootstrap_failed_reqs += 1
            raise RequestAborted(
                f"Decode handshake failed for request rank=0 decode_req.req.rid={item.rid!r} "
                f"decode_req.req.bootstrap_room={item.bootstrap_room} with exception {exc}"
            ) from None
        modeled_bytes = len(item.prompt_ids) * engine.timing.kv_bytes_per_token
        engine.stats.count_transfer(modeled_bytes, time.monotonic() - started)
        return pulled

    async def _decode(self, item: GenItem, pulled: PulledKV, emit: Emit) -> None:
        planned = output_ids_from_payload(pulled.payload, item.max_new_tokens)
        if not planned:
            finish = {"type": "length", "length": 0}
            progress = Progress([], "", finish, pulled.source, pulled.cached_tokens)
            if item.return_logprob:
                progress.input_token_logprobs = self.input_logprobs(item)
                progress.output_token_logprobs = []
            emit(progress)
            return
        held = [len(item.prompt_ids)]
        self._context_tokens += held[0]
        try:
            await self._generate(item, planned, pulled, emit, held)
        finally:
            self._context_tokens -= held[0]

    async def _generate(
        self, item: GenItem, planned: list[int], pulled: PulledKV, emit: Emit, held: list[int]
    ) -> None:
        """One token per decode step; a step is as long as the whole running batch and the
        context it attends to make it (``held[0]``: this request's share of that context)."""
        engine = self._engine
        timing = engine.timing
        ids: list[int] = []
        text = ""
        input_logprobs = self.input_logprobs(item) if item.return_logprob else None
        for token_id in planned:
            batch_size = engine.num_running
            started = time.monotonic()
            await timing.wait(timing.decode_step_secs(batch_size, self._context_tokens))
            engine.stats.count_decode_step(batch_size, (time.monotonic() - started) * 1e6)
            self._context_tokens += 1
            held[0] += 1
            ids.append(token_id)
            engine.stats.count_generated(1)
            finish = None
            if token_id in item.stop_token_ids:
                finish = {"type": "stop", "matched": token_id}
            else:
                text += " " + WORDS[token_id % len(WORDS)]
                text, finish = apply_stop(text, item.stop)
            if finish is None and len(ids) == item.max_new_tokens:
                finish = {"type": "length", "length": item.max_new_tokens}
            progress = Progress(list(ids), text, finish, pulled.source, pulled.cached_tokens)
            if input_logprobs is not None:
                progress.input_token_logprobs = input_logprobs
                progress.output_token_logprobs = [[token_logprob(t), t, None] for t in ids]
            emit(progress)
            if finish is not None:
                return

    def input_logprobs(self, item: GenItem) -> list[list[object]]:
        """The prompt's logprobs this server reports: none, the prefill reports them (a PD
        router puts the prefill's before the decode's)."""
        return []


class RegularRole(DecodeRole):
    """A regular (non-disaggregated) server: the prefill's batched forward, then the decode's
    steps, in one process; bootstrap fields are ignored and no KV moves."""

    name = REGULAR_MODE
    admit_stage = "waiting"

    def __init__(self, engine: RoleHost) -> None:
        super().__init__(engine)
        self._prefill = PrefillRole(engine)

    @property
    def queued_tokens(self) -> int:
        """Uncached prompt tokens waiting for this server's prefill forward."""
        return self._prefill.queued_tokens

    def start(self) -> None:
        self._prefill.start()

    async def teardown(self) -> None:
        await self._prefill.teardown()
        await super().teardown()

    async def _receive(self, item: GenItem, req: Req) -> PulledKV:
        """The prompt's KV computed here, in the prefill batcher's next forward."""
        cached = await self._prefill.forward(req, item.prompt_ids)
        return PulledKV(pack_prompt(item.prompt_ids), None, cached)

    def input_logprobs(self, item: GenItem) -> list[list[object]]:
        """The prompt's logprobs, as the prefill of a PD pair gives them."""
        return _input_logprobs(item.prompt_ids)


def apply_stop(text: str, stop: tuple[str, ...]) -> tuple[str, dict[str, object] | None]:
    """Cut the text before the first stop string it contains (SGLang trims the stop string)."""
    for stop_str in stop:
        index = text.find(stop_str)
        if index >= 0:
            return text[:index], {"type": "stop", "matched": stop_str}
    return text, None


def _input_logprobs(prompt_ids: list[int]) -> list[list[object]]:
    """SGLang's shape: ``[logprob, token_id, text]`` per prompt token, the first logprob None."""
    return [[None if i == 0 else token_logprob(t), t, None] for i, t in enumerate(prompt_ids)]


def _loop_time(monotonic_deadline: float) -> float:
    """Convert a time.monotonic() deadline to the event loop's clock."""
    loop = asyncio.get_running_loop()
    return loop.time() + (monotonic_deadline - time.monotonic())
