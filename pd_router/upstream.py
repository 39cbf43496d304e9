"""One leg of a PD request: a POST to one worker on the legs' connection pool, and what its
failure means.

Every leg records its outcome on the worker's circuit breaker and in the upstream error metric,
so the request path only has to decide what to do next: retry with a new pair, pass the worker's
answer through, or fail.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from pd_router.http1 import Http1Pool, Response, UpstreamConnectError, UpstreamDisconnected
from pd_router.workers import Role, Worker

RETRYABLE_STATUSES = frozenset({502, 503, 504})
UPSTREAM_ERRORS = (UpstreamConnectError, UpstreamDisconnected, TimeoutError)
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
ERROR_EXCERPT_BYTES = 500


@dataclass(slots=True)
class LegResult:
    status: int
    body: bytes
    content_type: str


class LegFailed(Exception):
    """A leg ended without a usable answer: transport error, timeout, or a non-2xx status."""

    def __init__(
        self,
        role: Role,
        worker: Worker,
        kind: str,
        message: str,
        *,
        retryable: bool,
        result: LegResult | None = None,
    ) -> None:
        super().__init__(message)
        self.role = role
        self.worker = worker
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.result = result

    @property
    def status(self) -> int | None:
        return self.result.status if self.result is not None else None


ErrorCounter = Callable[[Role, str], None]


def classify_exception(exc: BaseException) -> tuple[str, bool]:
    """(metric kind, retryable) for a transport-level failure."""
    if isinstance(exc, UpstreamConnectError):
        return "connect", True
    if isinstance(exc, TimeoutError):
        return "timeout", False
    return "disconnect", True


def transport_failure(role: Role, worker: Worker, exc: BaseException) -> LegFailed:
    kind, retryable = classify_exception(exc)
    detail = str(exc) or type(exc).__name__
    return LegFailed(
        role,
        worker,
        kind,
        f"{role.value} worker {worker.url}: {kind}: {detail}",
        retryable=retryable,
    )


def status_failure(role: Role, worker: Worker, result: LegResult) -> LegFailed:
    kind = "http_5xx" if result.status >= 500 else "http_4xx"
    excerpt = result.body[:ERROR_EXCERPT_BYTES].decode("utf-8", "replace")
    return LegFailed(
        role,
        worker,
        kind,
        f"{role.value} worker {worker.url} answered {result.status}: {excerpt}",
        retryable=result.status in RETRYABLE_STATUSES,
        result=result,
    )


def record_outcome(worker: Worker, failure: LegFailed | None, count_error: ErrorCounter) -> None:
    """Feed the circuit breaker: a worker that rejects a bad request is still a working one."""
    if failure is None:
        worker.circuit.record_success()
        return
    count_error(failure.role, failure.kind)
    if failure.kind == "http_4xx":
        worker.circuit.record_success()
    else:
        worker.circuit.record_failure()


def recorded(worker: Worker, failure: LegFailed, count_error: ErrorCounter) -> LegFailed:
    """``failure``, after it was fed to the worker's circuit and the error metric (to raise)."""
    record_outcome(worker, failure, count_error)
    return failure


async def fetch(
    pool: Http1Pool,
    role: Role,
    worker: Worker,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    count_error: ErrorCounter,
) -> LegResult:
    """POST ``payload`` and read the whole answer; LegFailed unless the status is 2xx."""
    response: Response | None = None
    try:
        response = await pool.post(url, payload, headers)
        body = await response.read()
    except asyncio.CancelledError:
        if response is not None:
            response.close()
        worker.circuit.release_trial()
        raise
    except UPSTREAM_ERRORS as exc:
        if response is not None:
            response.close()
        raise recorded(worker, transport_failure(role, worker, exc), count_error) from exc
    result = LegResult(response.status, body, response.content_type)
    if result.status >= 300:
        raise recorded(worker, status_failure(role, worker, result), count_error)
    record_outcome(worker, None, count_error)
    return result


async def open_stream(
    pool: Http1Pool,
    role: Role,
    worker: Worker,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    count_error: ErrorCounter,
) -> Response:
    """POST ``payload`` and return the response once its head arrived with a 2xx status (the
    caller reads the body, records the outcome and releases or closes it); LegFailed otherwise."""
    try:
        response = await pool.post(url, payload, headers)
    except asyncio.CancelledError:
        worker.circuit.release_trial()
        raise
    except UPSTREAM_ERRORS as exc:
        raise recorded(worker, transport_failure(role, worker, exc), count_error) from exc
    if response.status < 300:
        return response
    try:
        body = await response.read()
    except UPSTREAM_ERRORS:
        response.close()
        body = b""
    result = LegResult(response.status, body, response.content_type)
    raise recorded(worker, status_failure(role, worker, result), count_error)


async def abort(session: aiohttp.ClientSession, worker: Worker, rids: list[str]) -> None:
    """Ask ``worker`` to drop the request's rids (client gone or other leg failed); best effort,
    the worker may already have finished or be unreachable."""
    for rid in rids:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.post(
                worker.url + "/abort_request",
                data=orjson.dumps({"rid": rid}),
                headers={"Content-Type": "application/json"},
                timeout=ABORT_TIMEOUT,
            ) as resp:
                await resp.read()
