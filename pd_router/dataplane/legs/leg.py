"""One leg of a PD request: a POST to one worker on the legs' connection pool, and what its
failure means.

Every leg records its outcome on the worker's circuit breaker and in the upstream error metric,
so the request path only has to decide what to do next: retry with a new pair, pass the worker's
answer through, or fail. The router's own failures (out of file descriptors, its connection cap
per worker) are not the worker's: neither its circuit nor its error count sees them.

The legs that carry a pair's rendezvous (every prefill leg, whose answer comes once the decode
pulled its KV, and a streaming decode, whose first event comes after it) must see their first
byte within ``rendezvous_timeout_secs`` when that is shorter than the first-byte timeout. Missing
it is the pair's failure (kind ``rendezvous``): no verdict on either worker's circuit, the pair
goes to the quarantine (:mod:`pd_router.dataplane.routing.pairs`) and the request to another pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp
import orjson

from pd_protocol.wire import MISDIRECTED_STATUS
from pd_router.dataplane.legs.aborts import Abort, find_abort
from pd_router.dataplane.legs.connection import (
    LegTimeout,
    LocalResourceError,
    Phase,
    UpstreamConnectError,
    UpstreamDisconnected,
)
from pd_router.dataplane.legs.pool import Http1Pool, LegLimits, PoolTimeout, Response
from pd_router.dataplane.routing.pairs import PairQuarantine
from pd_router.dataplane.routing.target import Target
from pd_router.roles import Role

RETRYABLE_STATUSES = frozenset({502, 503, 504})
# What SGLang's decode answers (HTTP 500) for a request whose KV hand-off failed or was aborted:
# "Decode transfer failed for request ... KVTransferError(...)".
KV_TRANSFER_FAILED = b"transfer failed"
UPSTREAM_ERRORS = (
    UpstreamConnectError,
    UpstreamDisconnected,
    LegTimeout,
    PoolTimeout,
    LocalResourceError,
)
ABORT_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
ERROR_EXCERPT_BYTES = 500


class Verdict(StrEnum):
    """What a leg's outcome says about its worker, for the circuit breaker."""

    FAILURE = "failure"
    SUCCESS = "success"  # it answered (a 4xx is the request's fault)
    NONE = "none"  # the router's own fault, or the request was aborted on purpose


# A leg sent to a worker that serves the other role now (an extension worker's 421).
WRONG_ROLE = "wrong_role"

# A prefill leg or a streaming decode without its first byte within the rendezvous wait.
RENDEZVOUS = "rendezvous"
TIMEOUT_KINDS = frozenset({"timeout", RENDEZVOUS})

# A worker's 4xx that says the request itself is wrong (bad parameters, unknown model, too
# long): the client's error. It reaches the client with its status (counted under that status
# in requests_total) and is neither the worker's upstream error nor a failure of its circuit.
# Other 4xx (401/403: the router's worker key, 405, 408, 429) say the worker refused the router
# and stay upstream errors of kind http_4xx.
CLIENT_ERROR = "client_error"
CLIENT_ERROR_STATUSES = frozenset({400, 404, 413, 422})

# Kinds of failure that are the router's own (no worker answered wrong): not counted as the
# worker's upstream errors, and the client gets 503 with Retry-After.
LOCAL_KINDS = frozenset({"local", "pool_timeout"})


ErrorCounter = Callable[[Role, str], None]


@dataclass(slots=True)
class LegResult:
    status: int
    body: bytes
    content_type: str


@dataclass(slots=True)
class Legs:
    """What every leg of a request uses: the pool, its limits, the error metric, and this
    process's quarantine of the pairs that missed a rendezvous."""

    pool: Http1Pool
    limits: LegLimits
    count_error: ErrorCounter
    pairs: PairQuarantine = field(init=False)
    # The limits of the legs that carry the rendezvous: their first byte is due within the
    # rendezvous wait when that is the shorter of the two.
    meeting: LegLimits = field(init=False)

    def __post_init__(self) -> None:
        limits = self.limits
        self.pairs = PairQuarantine(limits.rendezvous_cooldown_secs)
        self.meeting = dataclasses.replace(
            limits,
            first_byte_timeout_secs=min(
                limits.first_byte_timeout_secs, limits.rendezvous_timeout_secs
            ),
        )

    def failure(self, role: Role, worker: Target, exc: BaseException) -> LegFailed:
        """A leg that carries the rendezvous failed with ``exc``: a first-byte timeout at the
        rendezvous wait is the pair's failure, anything else (and anything of a regular
        worker's, which meets nobody) the worker's."""
        limits = self.limits
        if (
            role is not Role.REGULAR
            and isinstance(exc, LegTimeout)
            and exc.phase is Phase.FIRST_BYTE
            and limits.rendezvous_timeout_secs <= limits.first_byte_timeout_secs
        ):
            return rendezvous_failure(role, worker, limits.rendezvous_timeout_secs)
        return transport_failure(role, worker, exc)


class LegFailed(Exception):
    """A leg ended without a usable answer: transport error, timeout, a non-2xx status, or an
    answer that reports the request aborted."""

    def __init__(
        self,
        role: Role,
        worker: Target,
        kind: str,
        message: str,
        *,
        retryable: bool,
        result: LegResult | None = None,
        verdict: Verdict = Verdict.FAILURE,
    ) -> None:
        super().__init__(message)
        self.role = role
        self.worker = worker
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.result = result
        self.verdict = verdict

    @property
    def status(self) -> int | None:
        return self.result.status if self.result is not None else None

    @property
    def local(self) -> bool:
        """The router's own fault (out of file descriptors, connection cap)."""
        return self.kind in LOCAL_KINDS

    @property
    def client_error(self) -> bool:
        """The request's own fault, as the worker said with a 4xx (not an upstream error)."""
        return self.kind == CLIENT_ERROR

    @property
    def timed_out(self) -> bool:
        return self.kind in TIMEOUT_KINDS

    @property
    def stuck(self) -> bool:
        """The pair missed its rendezvous (the pair's failure, not the worker's)."""
        return self.kind == RENDEZVOUS

    @property
    def handoff_failed(self) -> bool:
        """A decode failed the request because its KV never came from the prefill (SGLang:
        "Decode transfer failed", also when the decode lost its prefill's heartbeat): the
        prefill is as likely at fault as the decode."""
        return (
            self.role is Role.DECODE
            and self.result is not None
            and self.result.status >= 500
            and KV_TRANSFER_FAILED in self.result.body
        )

    @property
    def wrong_role(self) -> bool:
        """The worker serves the other role now (changed outside this router)."""
        return self.kind == WRONG_ROLE


def classify_exception(exc: BaseException) -> tuple[str, bool, Verdict]:
    """(metric kind, retryable, verdict on the worker) for a transport-level failure."""
    if isinstance(exc, LocalResourceError):
        return "local", False, Verdict.NONE
    if isinstance(exc, PoolTimeout):
        return "pool_timeout", True, Verdict.NONE
    if isinstance(exc, UpstreamConnectError):
        return "connect", True, Verdict.FAILURE
    if isinstance(exc, LegTimeout):
        return "timeout", exc.phase is not Phase.TOTAL, Verdict.FAILURE
    return "disconnect", True, Verdict.FAILURE


def transport_failure(role: Role, worker: Target, exc: BaseException) -> LegFailed:
    kind, retryable, verdict = classify_exception(exc)
    detail = str(exc) or type(exc).__name__
    return LegFailed(
        role,
        worker,
        kind,
        f"{role.value} worker {worker.url}: {kind}: {detail}",
        retryable=retryable,
        verdict=verdict,
    )


def rendezvous_failure(role: Role, worker: Target, wait: float) -> LegFailed:
    """No first byte within the rendezvous wait: retried on another pair, no verdict on the
    worker (the same worker may be fine with every other peer)."""
    return LegFailed(
        role,
        worker,
        RENDEZVOUS,
        f"{role.value} worker {worker.url}: no first byte within the {wait:g} s rendezvous wait "
        "(the prefill and the decode never met)",
        retryable=True,
        verdict=Verdict.NONE,
    )


def status_failure(role: Role, worker: Target, result: LegResult) -> LegFailed:
    """A non-2xx answer. 502/503/504 are retried on a new pair, and so is any 5xx of a prefill:
    it failed before a token was made (SGLang: a KV hand-off that failed), as a prefill
    stream's abort event with a 5xx is; and a decode's 5xx that says its KV transfer failed
    (nothing was generated; a decode stream's abort event with a 5xx is retried too). A 421
    says the worker now serves the other role (changed outside this router): retried on a new
    pair, no verdict on the worker (its role is re-read and it is moved)."""
    if result.status == MISDIRECTED_STATUS:
        return LegFailed(
            role, worker, WRONG_ROLE,
            f"{role.value} worker {worker.url} no longer serves as a {role.value}",
            retryable=True, result=result, verdict=Verdict.NONE,
        )  # fmt: skip
    kind = status_kind(result.status)
    excerpt = result.body[:ERROR_EXCERPT_BYTES].decode("utf-8", "replace")
    return LegFailed(
        role,
        worker,
        kind,
        f"{role.value} worker {worker.url} answered {result.status}: {excerpt}",
        retryable=result.status in RETRYABLE_STATUSES
        or (result.status >= 500 and (role is Role.PREFILL or KV_TRANSFER_FAILED in result.body)),
        result=result,
        verdict=Verdict.SUCCESS if result.status < 500 else Verdict.FAILURE,
    )


def status_kind(status: int) -> str:
    """The failure kind of a non-2xx answer other than 421."""
    if status >= 500:
        return "http_5xx"
    return CLIENT_ERROR if status in CLIENT_ERROR_STATUSES else "http_4xx"


def abort_failure(role: Role, worker: Target, abort: Abort) -> LegFailed:
    """A 2xx answer that reports the request aborted. With a 4xx status it is the request's
    error (passed to the client as that status); with a 5xx the worker failed it (retried on a
    new pair); without a status it was aborted on purpose (``/abort_request``): not retried,
    and no verdict on the worker."""
    message = f"{role.value} worker {worker.url} aborted the request: {abort.message}"
    status = abort.status
    if status is not None and status < 500:
        error = {"message": abort.message, "type": "invalid_request_error", "code": status}
        result = LegResult(status, orjson.dumps({"error": error}), "application/json")
        return LegFailed(
            role, worker, status_kind(status), message, retryable=False, result=result,
            verdict=Verdict.SUCCESS,
        )  # fmt: skip
    if status is not None:
        return LegFailed(role, worker, "abort", message, retryable=True)
    return LegFailed(role, worker, "abort", message, retryable=False, verdict=Verdict.NONE)


def record_outcome(worker: Target, failure: LegFailed | None, count_error: ErrorCounter) -> None:
    """Feed the circuit breaker and the error metric: a worker that rejects a bad request is
    still a working one and had no upstream error, and the router's own failures are not the
    worker's."""
    if failure is None:
        worker.circuit.record_success()
        return
    if not failure.local and not failure.client_error:
        count_error(failure.role, failure.kind)
    if failure.verdict is Verdict.SUCCESS:
        worker.circuit.record_success()
    elif failure.verdict is Verdict.FAILURE:
        worker.circuit.record_failure()
    else:
        worker.circuit.release_trial()


def recorded(worker: Target, failure: LegFailed, count_error: ErrorCounter) -> LegFailed:
    """``failure``, after it was fed to the worker's circuit and the error metric (to raise)."""
    record_outcome(worker, failure, count_error)
    return failure


async def _read(
    legs: Legs,
    role: Role,
    worker: Target,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    meets: bool,
) -> LegResult:
    """POST ``payload`` and read the whole answer; LegFailed (recorded) unless the status is
    2xx. A 2xx outcome is left for the caller to record. ``meets``: the answer carries the
    rendezvous (first-byte timeout, at most the rendezvous wait); otherwise it comes whole only
    at the end of a long generation, and no first-byte timeout applies."""
    response: Response | None = None
    limits = legs.meeting if meets else legs.limits
    try:
        response = await legs.pool.post(url, payload, headers, limits, first_byte=meets)
        body = await response.read()
    except asyncio.CancelledError:
        if response is not None:
            response.close()
        worker.circuit.release_trial()
        raise
    except UPSTREAM_ERRORS as exc:
        if response is not None:
            response.close()
        failure = legs.failure(role, worker, exc) if meets else transport_failure(role, worker, exc)
        raise recorded(worker, failure, legs.count_error) from exc
    result = LegResult(response.status, body, response.content_type)
    if result.status >= 300:
        raise recorded(worker, status_failure(role, worker, result), legs.count_error)
    return result


async def fetch_decode(
    legs: Legs,
    worker: Target,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    role: Role = Role.DECODE,
) -> LegResult:
    """A non-streaming decode leg (or a regular worker's whole request, ``role``): its answer
    comes whole when the generation ends, so no first-byte timeout applies, only the total (a
    frozen decode is found by the health probes). LegFailed unless the status is 2xx."""
    result = await _read(legs, role, worker, url, payload, headers, False)
    record_outcome(worker, None, legs.count_error)
    return result


async def fetch_prefill(
    legs: Legs, worker: Target, url: str, payload: bytes, headers: dict[str, str]
) -> LegResult:
    """A prefill leg, streaming or not (read whole). An answer that reports the request
    aborted is a failed leg: the decode would wait for KV that never comes."""
    result = await _read(legs, Role.PREFILL, worker, url, payload, headers, True)
    abort = find_abort(result.body, result.content_type)
    if abort is not None:
        raise recorded(worker, abort_failure(Role.PREFILL, worker, abort), legs.count_error)
    record_outcome(worker, None, legs.count_error)
    return result


async def open_stream(
    legs: Legs,
    worker: Target,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    role: Role = Role.DECODE,
) -> Response:
    """POST ``payload`` to a streaming decode (or regular worker, ``role``) and return the
    response once its head arrived with a 2xx status (the caller reads the body, records the
    outcome and releases or closes it); LegFailed otherwise. A decode's first event carries the
    rendezvous: it is due within the rendezvous wait (:meth:`Legs.failure` names a miss)."""
    limits = legs.limits if role is Role.REGULAR else legs.meeting
    try:
        response = await legs.pool.post(url, payload, headers, limits)
    except asyncio.CancelledError:
        worker.circuit.release_trial()
        raise
    except UPSTREAM_ERRORS as exc:
        raise recorded(worker, legs.failure(role, worker, exc), legs.count_error) from exc
    if response.status < 300:
        return response
    try:
        body = await response.read()
    except UPSTREAM_ERRORS:
        response.close()
        body = b""
    result = LegResult(response.status, body, response.content_type)
    raise recorded(worker, status_failure(role, worker, result), legs.count_error)


async def abort(session: aiohttp.ClientSession, worker: Target, rids: list[str]) -> None:
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
