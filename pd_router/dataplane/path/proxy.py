"""The PD request path: pair selection, bootstrap injection, fan-out, streaming relay, merges,
retries.

Each client request becomes one or more attempts. An attempt picks a prefill and a decode, points
the decode at the prefill (bootstrap host, port, fresh rooms), and sends the same body to both at
once. Each leg counts its worker in flight until that leg ended: a prefill answers once the
decode pulled its KV (SGLang's prefill finishes a request when its transfer completed), so a
draining prefill is free while the decodes still stream its answers. If a leg fails before the
client got a byte, the other leg is cancelled (and told to abort) and, for transport errors and
502/503/504, the request is retried on a new pair with new rooms. After the first byte a failure
ends the stream with an SSE error event. A client that goes away cancels both legs and both
workers get ``/abort_request``. A request with ``n > 1`` is served as ``n`` such requests, one
per sample (:mod:`pd_router.dataplane.path.fanout`: SGLang's PD cannot serve ``n > 1``).

A pair that does not meet within the rendezvous wait (the prefill's answer, and for a stream
the decode's first event: :mod:`pd_router.dataplane.legs.leg`) has both legs ended and both
workers told to abort; the pair is quarantined (:mod:`pd_router.dataplane.routing.pairs`) and the
request retried on another pair: the decode for a chosen prefill is picked avoiding the decodes
quarantined with it, and a prefill left with quarantined decodes only gives way to another.

With tracing on, the request's span (:mod:`pd_router.otel_tracing`) gets a span per leg of
every attempt, and each leg's ``traceparent`` names its own span to its worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from pd_router.dataplane.front.reply import Answer, sse_error_event
from pd_router.dataplane.legs.aborts import find_abort
from pd_router.dataplane.legs.leg import (
    UPSTREAM_ERRORS,
    LegFailed,
    LegResult,
    Legs,
    abort_failure,
    fetch_decode,
    fetch_prefill,
    open_stream,
    record_outcome,
    recorded,
    transport_failure,
)
from pd_router.dataplane.legs.pool import Response
from pd_router.dataplane.path.collaborators import PathCollaborators
from pd_router.dataplane.path.logprobs import merge_body, merged_events, prefill_logprobs
from pd_router.dataplane.path.requests import (
    Endpoint,
    inject_bootstrap,
    item_rids,
    logprobs_requested,
    router_rid,
)
from pd_router.dataplane.routing.policies import prompt_key
from pd_router.dataplane.routing.pools import Route
from pd_router.dataplane.routing.retry import attempts, backoff_secs
from pd_router.dataplane.routing.target import Target
from pd_router.errors import (
    ClientClosedRequest,
    NoWorkers,
    RouterOverloaded,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pd_router.roles import Role

if TYPE_CHECKING:
    from pd_router.otel_tracing import ExchangeSpan, LegSpans, RequestSpan

log = logging.getLogger("pd_router.dataplane.proxy")

T = TypeVar("T")

SSE_HEADERS: Mapping[str, str] = MappingProxyType(
    {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
)
SSE_HEAD = tuple(SSE_HEADERS.items())
# The event that ends an SGLang or OpenAI stream: once relayed, the client has its answer.
END_EVENT = b"data: [DONE]\n\n"


async def guarded(main: asyncio.Task[T], guard: asyncio.Task) -> T:
    """``main``'s result, unless ``guard`` fails first: then ``main`` is cancelled and the
    guard's error raised (the prefill failing while the decode waits for its KV)."""
    if not main.done() and not guard.done():
        await asyncio.wait((main, guard), return_when=asyncio.FIRST_COMPLETED)
    if not main.done():
        error = guard.exception()
        if error is not None:
            main.cancel()
            raise error
        return await main
    return main.result()


def retrieve(task: asyncio.Task) -> None:
    """Mark a finished task's exception as seen (it was already handled or recorded)."""
    if task.done() and not task.cancelled():
        task.exception()


class Routed:
    """What every served request keeps across its attempts, PD or regular: its body, ids, the
    route of its model, its trace span (None: tracing off), the prompt a cache-aware policy
    keys on, the rids workers know it by."""

    def __init__(
        self,
        path: PathCollaborators,
        reply: Answer,
        ids: tuple[str, str],
        endpoint: Endpoint,
        body: dict[str, Any],
        items: int | None,
        started: float,
        route: Route | None = None,
        span: RequestSpan | None = None,
    ) -> None:
        self.path = path
        self.reply = reply
        self.route = route
        self.endpoint = endpoint
        self.body = body
        self.items = items
        self.started = started
        self.request_id, self.upstream_id = ids
        self.client_rid = body.get("rid")
        self.stream = bool(body.get("stream"))
        self._prompt_key: str | None = None
        self.span: ExchangeSpan | None = span.exchange() if span is not None else None

    @property
    def model(self) -> str:
        """The model the request is served by ("" when its workers name none)."""
        route = self.route
        return "" if route is None else route.model

    def headers(self, role: Role) -> dict[str, str]:
        """The headers of a leg to a worker of ``role``."""
        return {**self.path.leg_headers[role], "X-Request-Id": self.request_id}

    def routing_prompt(self) -> str:
        """The prompt a cache-aware policy keys on, computed on first use and kept for both
        pools and every attempt."""
        if self._prompt_key is None:
            self._prompt_key = prompt_key(self.body)
        return self._prompt_key

    def payload(self, attempt: int) -> tuple[bytes, list[str]]:
        """The body for this attempt (with the rid workers know it by) and its rids."""
        if self.client_rid is not None:
            rids = item_rids(self.client_rid, self.items)
        else:
            base = self.upstream_id if attempt == 0 else f"{self.upstream_id}-{attempt}"
            self.body["rid"], rids = router_rid(self.endpoint, base, self.items)
        return orjson.dumps(self.body), rids


class Exchange(Routed):
    """One client request across its attempts."""

    def __init__(
        self,
        path: PathCollaborators,
        reply: Answer,
        ids: tuple[str, str],
        endpoint: Endpoint,
        body: dict[str, Any],
        items: int | None,
        started: float,
        route: Route | None = None,
        span: RequestSpan | None = None,
    ) -> None:
        super().__init__(path, reply, ids, endpoint, body, items, started, route, span)
        self.prefill_headers = self.headers(Role.PREFILL)
        self.decode_headers = self.headers(Role.DECODE)
        # When the current attempt's prefill answered (loop time), to split TTFT between pools.
        self.prefilled_at: float | None = None
        self.merge = endpoint.native and logprobs_requested(body.get("return_logprob"))
        # The current attempt's leg spans (None: tracing off).
        self.leg_spans: LegSpans | None = None

    async def run(self) -> None:
        retry = self.path.retry
        pools = self.path.pools
        pairs = self.path.legs.pairs
        avoid: list[Target] = []
        attempt = 0
        last: LegFailed | None = None
        while True:
            try:
                prefill, decode = self.pick_pair(avoid)
            except NoWorkers:
                if last is None:
                    raise
                await failure_response(self.reply, last)
                return
            payload, rids = self.prepare(attempt, prefill)
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "routing",
                    extra={"request_id": self.request_id, "attempt": attempt,
                           "prefill": prefill.url, "decode": decode.url, "items": self.items},
                )  # fmt: skip
            trial = pairs.dispatch(prefill, decode)
            try:
                if self.stream:
                    await self.stream_attempt(prefill, decode, payload, rids)
                else:
                    await self.unary_attempt(prefill, decode, payload, rids)
                return
            except LegFailed as failure:
                # Its traceback holds this attempt's frames, which hold the leg tasks, which
                # hold the failure: a cycle that kept the request body alive until a full
                # collection (tune_gc makes those rare).
                failure.__traceback__ = None
                # A request the worker rejected as invalid is the client's mistake, not a
                # worker failing: no warning per bad request.
                log.log(
                    logging.INFO if failure.client_error else logging.WARNING,
                    "upstream leg failed",
                    extra={
                        "request_id": self.request_id,
                        "attempt": attempt,
                        "role": failure.role.value,
                        "worker": failure.worker.url,
                        "kind": failure.kind,
                        "error": failure.message,
                    },
                )
                if failure.wrong_role or failure.kind == "connect":
                    # Read at once: moved if in another role, unhealthy if the worker is gone.
                    pools.suspect(failure.worker)
                if failure.stuck:
                    pairs.stuck(prefill, decode)
                    pools.stuck(prefill, decode)
                attempt += 1
                if not failure.retryable or attempt >= attempts(retry):
                    await failure_response(self.reply, failure)
                    return
                # After a missed rendezvous the retry prefers another prefill: the decodes that
                # kept a round-tripped prefill's old endpoints are all of those that talked to it
                # (SGLang 0.5.23), so its other pairs are likely stuck too.
                avoid.append(prefill if failure.stuck else failure.worker)
                if failure.handoff_failed:
                    # The retry also leaves this prefill: a decode that lost it (a heartbeat
                    # missed on a saturated prefill) fails every room it sends.
                    avoid.append(prefill)
                last = failure
            finally:
                if trial:
                    pairs.end_trial(prefill, decode)
            self.path.metrics.count_retry()
            await asyncio.sleep(backoff_secs(retry, attempt))

    def pick_pair(self, avoid: list[Target]) -> tuple[Target, Target]:
        """A prefill, and a decode for it that is not quarantined with it; a prefill left with
        quarantined decodes only gives way to another prefill (whose pair is taken as it
        comes: with nothing else left, a quarantined pair is used, as a circuit's panic mode
        uses open circuits)."""
        pools = self.path.pools
        pairs = self.path.legs.pairs
        prompt = self.routing_prompt
        route = self.route
        prefill = pools.pick(Role.PREFILL, avoid, prompt, route)
        decode = pools.pick(Role.DECODE, pairs.avoid(prefill, avoid), prompt, route)
        if pairs.blocks(prefill, decode):
            other = pools.pick(Role.PREFILL, [*avoid, prefill], prompt, route)
            if other is not prefill:
                return other, pools.pick(Role.DECODE, pairs.avoid(other, avoid), prompt, route)
        return prefill, decode

    def prepare(self, attempt: int, prefill: Target) -> tuple[bytes, list[str]]:
        """The body for this attempt (new rooms, the rid workers know it by) and its rids."""
        inject_bootstrap(self.body, prefill, self.items)
        return self.payload(attempt)

    def cleanup(
        self,
        legs: list[tuple[asyncio.Task, Target, bool]],
        rids: list[str],
    ) -> list[asyncio.Task]:
        """Cancel unfinished legs and send ``/abort_request`` to each worker flagged for it;
        returns the tasks to wait for."""
        pending = []
        for task, worker, must_abort in legs:
            if not task.done():
                task.cancel()
                pending.append(task)
            else:
                retrieve(task)
            if must_abort or not task.done():
                self.path.abort(worker, rids)
        return pending

    def observe_ttft(self) -> None:
        seconds = asyncio.get_running_loop().time() - self.started
        self.path.metrics.observe_ttft(seconds)
        if self.stream:
            prefilled = self.prefilled_at
            self.path.latency.observe_ttft(
                seconds, None if prefilled is None else prefilled - self.started, self.model
            )

    def prefill_ended(self, prefill: Target, task: asyncio.Task) -> None:
        """The prefill leg ended (answered, failed or cancelled): the prefill is no longer in
        flight for it; an answer marks when the decode's part of TTFT began."""
        self.path.pools.release(prefill)
        if not task.cancelled() and task.exception() is None:
            self.prefilled_at = asyncio.get_running_loop().time()

    def start_legs(
        self,
        prefill: Target,
        decode: Target,
        payload: bytes,
        decode_leg: Callable[..., Coroutine[Any, Any, T]],
    ) -> tuple[asyncio.Task[LegResult], asyncio.Task[T]]:
        """Count the request in flight on both workers and send ``payload`` to both at once
        (with tracing on, each leg's headers carry its span's ``traceparent``); the prefill's
        answer is always read whole, the decode's by ``decode_leg``. The prefill
        is released when its leg ends (a done callback runs even for a task cancelled before
        it started), the decode by the attempt once its leg ended."""
        pools = self.path.pools
        pools.acquire(prefill)
        pools.acquire(decode)
        path = self.endpoint.path
        legs = self.path.legs
        headers = self.prefill_headers, self.decode_headers
        if self.span is not None:
            model = self.body.get("model")
            self.leg_spans = self.span.attempt(prefill.url, decode.url, path, model, headers)
            headers = self.leg_spans.prefill_headers, self.leg_spans.decode_headers
        p_task = asyncio.create_task(
            fetch_prefill(legs, prefill, prefill.url + path, payload, headers[0])
        )
        self.prefilled_at = None
        p_task.add_done_callback(functools.partial(self.prefill_ended, prefill))
        d_task = asyncio.create_task(
            decode_leg(legs, decode, decode.url + path, payload, headers[1])
        )
        if self.leg_spans is not None:
            p_task.add_done_callback(self.leg_spans.prefill_ended)
        return p_task, d_task

    # --- non-streaming ----------------------------------------------------------------------

    async def unary_attempt(
        self, prefill: Target, decode: Target, payload: bytes, rids: list[str]
    ) -> None:
        pools = self.path.pools
        p_task, d_task = self.start_legs(prefill, decode, payload, fetch_decode)
        abort_both = False
        try:
            p_result, d_result = await join_unary(p_task, d_task)
        except asyncio.CancelledError:
            abort_both = True
            raise
        except LegFailed as failure:
            abort_both = failure.stuck
            raise
        finally:
            pending = self.cleanup(
                [(p_task, prefill, abort_both), (d_task, decode, abort_both)], rids
            )
            if pending:
                await asyncio.wait(pending)
            pools.release(decode)
            if self.leg_spans is not None:
                self.leg_spans.decode_ended((d_task,), None)
        self.path.legs.pairs.met(prefill, decode)
        body = d_result.body
        if self.merge and p_result is not None:
            body = merge_body(body, prefill_logprobs(p_result.body))
        self.observe_ttft()
        await self.reply.send(d_result.status, body, d_result.content_type)

    # --- streaming --------------------------------------------------------------------------

    async def stream_attempt(
        self, prefill: Target, decode: Target, payload: bytes, rids: list[str]
    ) -> None:
        pools = self.path.pools
        legs = self.path.legs
        p_task, d_task = self.start_legs(prefill, decode, payload, open_stream)
        first_task: asyncio.Task | None = None
        d_resp: Response | None = None
        decode_done = False
        client_gone = False
        stuck = False
        try:
            d_resp = await guarded(d_task, p_task)
            pieces: AsyncIterator[bytes] = d_resp.chunks()
            if self.merge:
                p_result = await p_task
                pieces = merged_events(pieces, prefill_logprobs(p_result.body))
            first_task = asyncio.create_task(first_piece(pieces, decode, d_resp.content_type, legs))
            first = await guarded(first_task, p_task)
            legs.pairs.met(prefill, decode)
            try:
                await self.start_stream(d_resp)
            except ConnectionResetError:
                client_gone = True
                raise ClientClosedRequest("client closed the connection") from None
            decode_done, client_gone = await relay(self, first, pieces, decode, Role.DECODE)
            if not client_gone:
                try:
                    await self.reply.end()
                except ConnectionResetError:
                    client_gone = True
            if not client_gone:
                await asyncio.wait((p_task,))
        except asyncio.CancelledError:
            client_gone = True
            raise
        except LegFailed as failure:
            stuck = failure.stuck
            raise
        finally:
            pending = self.cleanup(
                [(p_task, prefill, client_gone or stuck), (d_task, decode, not decode_done)],
                rids,
            )
            if not decode_done:
                decode.circuit.release_trial()
            if first_task is not None and not first_task.done():
                first_task.cancel()
                pending.append(first_task)
            if d_resp is not None:
                if decode_done:
                    d_resp.release()
                else:
                    d_resp.close()
            if pending:
                await asyncio.wait(pending)
            pools.release(decode)
            if self.leg_spans is not None:
                self.leg_spans.decode_ended((d_task, first_task), decode_done)

    async def start_stream(self, d_resp: Response) -> None:
        content_type = d_resp.content_type or "text/event-stream"
        await self.reply.start(d_resp.status, (("Content-Type", content_type), *SSE_HEAD))
        self.observe_ttft()


async def relay(
    request: Routed,
    first: bytes,
    pieces: AsyncIterator[bytes],
    worker: Target,
    role: Role,
) -> tuple[bool, bool]:
    """Copy the stream of ``worker`` (the decode, or a regular worker) to the client; returns
    (worker finished, client gone). Events are counted by their blank-line ends, for the time
    per output token. The answer counts as delivered (``reply.delivered``) from its end event
    on, or once the whole stream was relayed."""
    path, reply, request_id = request.path, request.reply, request.request_id
    loop = asyncio.get_running_loop()
    first_at = loop.time()
    events = first.count(b"\n\n")
    try:
        await reply.write(first)
        if first.endswith(END_EVENT):
            reply.delivered = reply.status
        async for piece in pieces:
            events += piece.count(b"\n\n")
            try:
                await reply.write(piece)
            except ConnectionResetError:
                return False, True
            if piece.endswith(END_EVENT):
                reply.delivered = reply.status
    except ConnectionResetError:
        return False, True
    except UPSTREAM_ERRORS as exc:
        failure = transport_failure(role, worker, exc)
        record_outcome(worker, failure, path.metrics.count_upstream_error)
        log.warning(
            "%s stream broke after the first byte",
            role.value,
            extra={"request_id": request_id, "worker": worker.url, "error": failure.message},
        )
        try:
            await reply.write(sse_error(failure.message, 504 if failure.timed_out else 502))
        except ConnectionResetError:
            return False, True
        return False, False
    reply.delivered = reply.status
    record_outcome(worker, None, path.metrics.count_upstream_error)
    path.latency.observe_stream(loop.time() - first_at, events, request.model)
    return True, False


async def join_unary(
    p_task: asyncio.Task[LegResult], d_task: asyncio.Task[LegResult]
) -> tuple[LegResult | None, LegResult]:
    """Both legs' results. A prefill that fails while the decode still waits ends the attempt
    at once; a prefill that fails after the decode answered does not spoil the answer."""
    await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
    if not d_task.done():
        p_result = p_task.result()
        return p_result, await d_task
    d_result = d_task.result()
    try:
        p_result = await p_task
    except LegFailed:
        return None, d_result
    return p_result, d_result


async def first_piece(
    pieces: AsyncIterator[bytes],
    decode: Target,
    content_type: str,
    legs: Legs,
    role: Role = Role.DECODE,
) -> bytes:
    """The decode's (or regular worker's, ``role``) first bytes; a stream that breaks or ends
    before them (or misses the rendezvous wait), or whose first event is an abort the worker
    gave a 5xx status (a KV hand-off that failed), is a retryable failure: nothing reached the
    client yet. Other aborts go to the client as sent."""
    count_error = legs.count_error
    try:
        piece = await anext(pieces)
    except StopAsyncIteration:
        piece = b""
    except UPSTREAM_ERRORS as exc:
        raise recorded(decode, legs.failure(role, decode, exc), count_error) from exc
    if not piece:
        failure = LegFailed(
            role, decode, "disconnect",
            f"{role.value} worker {decode.url} ended its stream without data", retryable=True,
        )  # fmt: skip
        raise recorded(decode, failure, count_error)
    abort = find_abort(piece, content_type)
    if abort is not None and abort.status is not None and abort.status >= 500:
        failure = abort_failure(role, decode, abort)
        raise recorded(decode, failure, count_error)
    return piece


def sse_error(message: str, status: int = 502) -> bytes:
    """The events that end a stream broken after its first byte (SGLang's error shape; the
    type says what a JSON answer's error would have said: upstream_error or upstream_timeout)."""
    error_type = UpstreamTimeout.error_type if status == 504 else UpstreamError.error_type
    return sse_error_event(message, error_type, status) + END_EVENT


async def failure_response(reply: Answer, failure: LegFailed) -> None:
    """What the client gets when the last attempt failed: a worker's own 4xx answer as is,
    otherwise a router error naming the leg that failed (503 with Retry-After when the router
    itself ran out of file descriptors or connections, the worker being fine)."""
    result = failure.result
    if failure.wrong_role:
        raise UpstreamUnavailable(failure.message)
    if result is not None and 400 <= result.status < 500:
        await reply.send(result.status, result.body, result.content_type)
        return
    if failure.local:
        raise RouterOverloaded(failure.message)
    if failure.status == 503:
        raise UpstreamUnavailable(failure.message)
    if failure.status == 504 or failure.timed_out:
        raise UpstreamTimeout(failure.message)
    raise UpstreamError(failure.message)
