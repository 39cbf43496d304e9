"""The regular request path: a model served by regular (colocated, non-PD) workers gets each
request on one worker, whole, as sglang-router's regular mode sends it.

An attempt picks a regular worker of the request's model (its pool's policy, circuits as for
every pool), sends the body as the client gave it (the rid the worker knows it by added, for
``/abort_request``), and relays the answer: whole, or as a stream. A failure before the client
got a byte is retried on another worker for transport errors and 502/503/504 (bounded by the
same retry settings as a PD pair); after the first byte a stream ends with an SSE error event.
A client that goes away cancels the leg and the worker gets ``/abort_request``. ``n > 1`` goes
to the worker as sent: a regular server samples it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from pd_router.dataplane.legs.leg import LegFailed, fetch_decode, open_stream
from pd_router.dataplane.legs.pool import Response
from pd_router.dataplane.path.proxy import (
    SSE_HEAD,
    Routed,
    failure_response,
    first_piece,
    relay,
)
from pd_router.dataplane.routing.retry import attempts, backoff_secs
from pd_router.dataplane.routing.target import Target
from pd_router.errors import ClientClosedRequest, NoWorkers
from pd_router.roles import Role

if TYPE_CHECKING:
    pass

if TYPE_CHECKING:
    pass

log = logging.getLogger("pd_router.dataplane.single")

REGULAR = Role.REGULAR


class Forward(Routed):
    """One client request to a regular worker, across its attempts."""

    async def run(self) -> None:
        retry = self.path.retry
        pools = self.path.pools
        avoid: list[Target] = []
        attempt = 0
        last: LegFailed | None = None
        while True:
            try:
                worker = pools.pick(REGULAR, avoid, self.routing_prompt, self.route)
            except NoWorkers:
                if last is None:
                    raise
                await failure_response(self.reply, last)
                return
            payload, rids = self.payload(attempt)
            try:
                await self.attempt(worker, payload, rids)
                return
            except LegFailed as failure:
                failure.__traceback__ = None
                log.log(
                    logging.INFO if failure.client_error else logging.WARNING,
                    "regular worker failed",
                    extra={"request_id": self.request_id, "attempt": attempt,
                           "worker": worker.url, "kind": failure.kind, "error": failure.message},
                )  # fmt: skip
                if failure.wrong_role or failure.kind == "connect":
                    pools.suspect(worker)
                attempt += 1
                if not failure.retryable or attempt >= attempts(retry):
                    await failure_response(self.reply, failure)
                    return
                avoid.append(worker)
                last = failure
            self.path.metrics.count_retry()
            await asyncio.sleep(backoff_secs(retry, attempt))

    async def attempt(self, worker: Target, payload: bytes, rids: list[str]) -> None:
        """One attempt on ``worker``; with tracing on, in a leg span whose ``traceparent``
        the worker gets."""
        span = self.span
        headers = self.headers(REGULAR)
        if span is None:
            await self.send(worker, payload, rids, headers)
            return
        leg = span.regular_attempt(worker.url, self.endpoint.path, self.body.get("model"), headers)
        try:
            relayed = await self.send(worker, payload, rids, leg.headers)
        except BaseException as error:
            leg.ended(error, None)
            raise
        leg.ended(None, relayed)

    async def send(
        self, worker: Target, payload: bytes, rids: list[str], headers: dict[str, str]
    ) -> bool | None:
        """Send the attempt and answer the client; whether a stream reached its end (None:
        not a stream)."""
        if self.stream:
            return await self.stream_attempt(worker, payload, rids, headers)
        await self.unary_attempt(worker, payload, rids, headers)
        return None

    def observe_ttft(self) -> None:
        self.path.metrics.observe_ttft(asyncio.get_running_loop().time() - self.started)

    async def unary_attempt(
        self, worker: Target, payload: bytes, rids: list[str], headers: dict[str, str]
    ) -> None:
        pools = self.path.pools
        pools.acquire(worker)
        url = worker.url + self.endpoint.path
        try:
            result = await fetch_decode(self.path.legs, worker, url, payload, headers, REGULAR)
        except asyncio.CancelledError:
            self.path.abort(worker, rids)
            raise
        finally:
            pools.release(worker)
        self.observe_ttft()
        await self.reply.send(result.status, result.body, result.content_type)

    async def stream_attempt(
        self, worker: Target, payload: bytes, rids: list[str], headers: dict[str, str]
    ) -> bool:
        """Relay the worker's stream; whether it reached its end."""
        pools = self.path.pools
        legs = self.path.legs
        pools.acquire(worker)
        url = worker.url + self.endpoint.path
        response: Response | None = None
        done = False
        try:
            response = await open_stream(legs, worker, url, payload, headers, REGULAR)
            pieces: AsyncIterator[bytes] = response.chunks()
            first = await first_piece(pieces, worker, response.content_type, legs, REGULAR)
            content_type = response.content_type or "text/event-stream"
            try:
                await self.reply.start(response.status, (("Content-Type", content_type), *SSE_HEAD))
            except ConnectionResetError:
                raise ClientClosedRequest("client closed the connection") from None
            self.observe_ttft()
            done, gone = await relay(self, first, pieces, worker, REGULAR)
            if not gone:
                with contextlib.suppress(ConnectionResetError):
                    await self.reply.end()
        finally:
            if not done:
                worker.circuit.release_trial()
                self.path.abort(worker, rids)
            if response is not None:
                if done:
                    response.release()
                else:
                    response.close()
            pools.release(worker)
        return done
