"""Admission of generation requests by number and rate: a cap on the requests proxied at once,
a FIFO queue for those beyond it, and a token bucket for their rate (the peers'
``--max-concurrent-requests``, ``--queue-size``, ``--queue-timeout-secs`` and
``--rate-limit-tokens-per-second``).

A request takes a token from the bucket when it arrives (an empty bucket: 429 at once, with
``Retry-After`` saying when the next token comes), then a slot: a free one at once, else it waits
in the queue; a full queue or a wait longer than ``queue_timeout_secs`` is a 429 with
``Retry-After``. A slot is held until the answer ended (a stream included) and then handed to the
oldest waiter, so the order of arrival is kept. A client that goes away while it waits leaves the
queue (and gives on a slot that was handed to it at that moment). smg answers a queue timeout
with 408; here every refusal is a 429, the status clients retry on.

Only generation requests are admitted this way: probes, metrics and the admin API must answer
while the router is saturated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from pd_router.errors import RouterError
from pd_router.metrics import RouterMetrics

QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
RATE_LIMITED = "rate_limited"
REJECTION_REASONS = (QUEUE_FULL, QUEUE_TIMEOUT, RATE_LIMITED)


@dataclass(frozen=True)
class AdmissionConfig:
    max_concurrent_requests: int = 0
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    rate_limit_tokens_per_second: float = 0.0

    def shared_by(self, processes: int) -> AdmissionConfig:
        """The share of one of ``processes`` data planes: each admits its part of the
        limits, so the router as a whole keeps them (up to the spread of connections)."""
        return dataclasses.replace(
            self,
            max_concurrent_requests=-(-self.max_concurrent_requests // processes),
            queue_size=-(-self.queue_size // processes),
            rate_limit_tokens_per_second=self.rate_limit_tokens_per_second / processes,
        )


class TooManyRequests(RouterError):
    """A generation request refused by the concurrency limit, its queue or the rate limit;
    ``reason`` (one of :data:`REJECTION_REASONS`) says which."""

    status = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, message: str, reason: str, retry_after_secs: int = 1) -> None:
        super().__init__(
            message, headers={"Retry-After": str(retry_after_secs)}, details={"reason": reason}
        )
        self.reason = reason


class TokenBucket:
    """``capacity`` tokens, refilled continuously at ``rate`` per second; starts full."""

    def __init__(
        self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._updated = clock()

    def take(self) -> float:
        """Take one token: 0.0 when there was one, else the seconds until there will be."""
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate


class RequestAdmission:
    """The concurrency cap, its queue and the rate limit of one router."""

    def __init__(
        self,
        config: AdmissionConfig,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._metrics = metrics
        self._active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._bucket = (
            TokenBucket(
                config.rate_limit_tokens_per_second,
                max(1, config.max_concurrent_requests),
                clock,
            )
            if config.rate_limit_tokens_per_second
            else None
        )
        limited = config.max_concurrent_requests or self._bucket is not None
        self._slot = Slot(self) if limited else None
        self._no_limits: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()
        self._rejections = {
            reason: metrics.admission_rejections_total.labels(reason)
            for reason in REJECTION_REASONS
        }
        metrics.admission_queue_depth.set(0)

    @property
    def active(self) -> int:
        """Requests holding a slot (always 0 without a concurrency cap)."""
        return self._active

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def admitted(self) -> contextlib.AbstractAsyncContextManager[None]:
        """For ``async with``: admits the request on entry (TooManyRequests if refused) and
        frees its slot on exit. Without limits a no-op context, which costs a request nothing."""
        return self._slot if self._slot is not None else self._no_limits

    async def admit(self) -> None:
        """Admit one request (TooManyRequests if refused); :meth:`finish` frees its slot."""
        self._take_token()
        if self.config.max_concurrent_requests:
            await self._acquire()

    def finish(self) -> None:
        if self.config.max_concurrent_requests:
            self._release()

    def _take_token(self) -> None:
        if self._bucket is None:
            return
        wait = self._bucket.take()
        if wait:
            self._reject(
                RATE_LIMITED,
                f"rate limit of {self.config.rate_limit_tokens_per_second:g} requests per "
                "second reached (rate_limit_tokens_per_second)",
                wait,
            )

    async def _acquire(self) -> None:
        config = self.config
        if self._active < config.max_concurrent_requests and not self._waiters:
            self._active += 1
            return
        if len(self._waiters) >= config.queue_size:
            self._reject(
                QUEUE_FULL,
                f"{self._active} requests in flight (max_concurrent_requests) and "
                f"{len(self._waiters)} waiting (queue_size {config.queue_size})",
                1,
            )
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._metrics.admission_queue_depth.set(len(self._waiters))
        try:
            async with asyncio.timeout(config.queue_timeout_secs):
                await waiter
        except TimeoutError:
            if not self._leave(waiter):
                self._reject(
                    QUEUE_TIMEOUT,
                    f"waited {config.queue_timeout_secs:g} s for one of "
                    f"{config.max_concurrent_requests} request slots (queue_timeout_secs)",
                    1,
                )
        except asyncio.CancelledError:
            if self._leave(waiter):
                self._release()
            raise

    def _leave(self, waiter: asyncio.Future[None]) -> bool:
        """Take a waiter that stopped waiting out of the queue; True when a slot was handed
        to it meanwhile (it holds that slot now)."""
        if waiter.done() and not waiter.cancelled():
            return True
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        self._metrics.admission_queue_depth.set(len(self._waiters))
        return False

    def _release(self) -> None:
        """Hand the slot to the oldest waiter still waiting, or free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._metrics.admission_queue_depth.set(len(self._waiters))
                return
        self._metrics.admission_queue_depth.set(0)
        self._active -= 1

    def _reject(self, reason: str, message: str, retry_after_secs: float) -> NoReturn:
        self._rejections[reason].inc()
        raise TooManyRequests(message, reason, max(1, math.ceil(retry_after_secs)))


class Slot(contextlib.AbstractAsyncContextManager[None]):
    """The ``async with`` of :meth:`RequestAdmission.admitted` when there are limits (a class:
    cheaper per request than a generator-based context manager). It holds no per-request
    state, so one serves every request."""

    __slots__ = ("_admission",)

    def __init__(self, admission: RequestAdmission) -> None:
        self._admission = admission

    async def __aenter__(self) -> None:
        await self._admission.admit()

    async def __aexit__(self, *exc_info: object) -> None:
        self._admission.finish()
