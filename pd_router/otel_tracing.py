"""Spans through OpenTelemetry's SDK, exported over OTLP/HTTP (the ``otel`` extra; loaded by
:func:`pd_router.runtime.tracing.start_tracing` only when tracing is on).

One :class:`Tracing` per process: its own tracer provider and batch exporter (a data-plane
process of ``--workers N`` exports its own spans). Spans are exported every 0.5 s, as smg does,
from the SDK's exporter thread; the event loop only starts and ends spans. Contexts are passed
explicitly (never the SDK's current span), so nothing leaks from one request to another.

The request path: a server span per client request (:class:`RequestSpan`), continuing the
client's ``traceparent`` when it sent one; per attempt a client span for each leg
(:class:`LegSpans`) whose W3C ``traceparent`` goes to that leg's worker. A failed leg is
recognised by the exception it ended with: the request path's ``LegFailed`` carries ``kind``
and ``status``.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pd_router.tracing import SpanRecord, TracingConfig, traces_url

# Spans reach the collector within about half a second (smg's delay), in exports of up to 512
# (the SDK's size: smg's 64 made a Python router post a batch per 20 requests at 1000 req/s);
# the queue holds several seconds of a busy router's spans before it drops any.
SCHEDULE_DELAY_MILLIS = 500
MAX_EXPORT_BATCH_SIZE = 512
MAX_QUEUE_SIZE = 16384
EXPORT_TIMEOUT_SECS = 10.0
# At exit the spans left are exported for this long at most: a collector that is down or never
# answers must not hold up a router's or a data plane's exit (the SDK alone waits up to 30 s).
SHUTDOWN_SECS = 2.0
PROPAGATOR = TraceContextTextMapPropagator()
# What a leg span says of how its leg ended (attribute pd.leg.outcome); only "failed" is an
# error: "cancelled" and "incomplete" (a stream cut short, the client gone) follow from
# something else.
OK, FAILED, CANCELLED, INCOMPLETE = "ok", "failed", "cancelled", "incomplete"


log = logging.getLogger("pd_router.tracing")


class Tracing:
    """This process's tracer and exporter."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("pd_router")
        self._stopped = False

    @classmethod
    def start(cls, config: TracingConfig, process: str) -> Tracing:
        """A provider exporting to ``config.endpoint``, sampling ``config.sample_ratio`` of new
        traces (a continued trace keeps its caller's decision); flushed at exit."""
        resource = Resource.create(
            {
                "service.name": config.service_name,
                "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
                "pd_router.process": process,
            }
        )
        provider = TracerProvider(
            resource=resource,
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            shutdown_on_exit=False,
        )
        exporter = OTLPSpanExporter(
            endpoint=traces_url(config.endpoint), timeout=EXPORT_TIMEOUT_SECS
        )
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=SCHEDULE_DELAY_MILLIS,
                max_export_batch_size=MAX_EXPORT_BATCH_SIZE,
                max_queue_size=MAX_QUEUE_SIZE,
            )
        )
        tracing = cls(provider)
        atexit.register(tracing.shutdown)
        return tracing

    def shutdown(self) -> None:
        """Export what is left and stop the exporter, within :data:`SHUTDOWN_SECS`: the
        SDK's own shutdown waits for an export in flight and retries a collector that refuses
        or never answers; past the bound its daemon threads are left to the process's exit and
        the spans they held are dropped, with a warning."""
        if self._stopped:
            return
        self._stopped = True
        stopping = threading.Thread(target=self.provider.shutdown, name="otel-stop", daemon=True)
        stopping.start()
        stopping.join(SHUTDOWN_SECS)
        if stopping.is_alive():
            log.warning(
                "the trace collector took no spans within %.0f s of the exit: the spans not "
                "exported yet are dropped",
                SHUTDOWN_SECS,
            )

    def request(
        self, method: str, route: str, headers: Mapping[str, str], request_id: str
    ) -> RequestSpan:
        """The server span of one client request, a child of the client's ``traceparent``
        (``headers``: lower-case names) when it sent one."""
        parent = PROPAGATOR.extract(headers)
        span = self.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "http.route": route,
                "pd.request_id": request_id,
            },
        )
        return RequestSpan(self.tracer, span)

    def record(self, record: SpanRecord, parent: Context | None = None) -> None:
        """Export a span tree that already ended (a conversion and its phases)."""
        span = self.tracer.start_span(
            record.name,
            context=parent if parent is not None else Context(),
            attributes=dict(record.attributes),
            start_time=nanoseconds(record.start),
        )
        if record.error is not None:
            span.set_status(Status(StatusCode.ERROR, record.error))
        for child in record.children:
            self.record(child, trace.set_span_in_context(span))
        span.end(end_time=nanoseconds(record.end))


def nanoseconds(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestSpan:
    """The span of one client request: the pair each attempt picked, the model, the retries,
    the status answered."""

    __slots__ = ("_context", "_tracer", "retries", "span")

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span
        self._context = trace.set_span_in_context(span)
        self.retries = 0

    def exchange(self) -> ExchangeSpan:
        """Where the attempts of the request (or of one of its samples, ``n > 1``) go."""
        return ExchangeSpan(self)

    def legs(
        self,
        attempt: int,
        urls: tuple[str, str],
        path: str,
        model: Any,
        headers: tuple[dict[str, str], dict[str, str]],
    ) -> LegSpans:
        """The leg spans of an attempt to the prefill and the decode at ``urls`` on ``path``;
        ``headers`` are the prefill's and the decode's, to which the legs' ``traceparent`` is
        added (in copies)."""
        attributes: dict[str, str] = {"pd.prefill.url": urls[0], "pd.decode.url": urls[1]}
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
        self.span.set_attributes(attributes)
        if attempt > 1:
            self.retries += 1
        return LegSpans(self._tracer, self._context, attempt, urls, path, headers)

    def regular_leg(
        self, attempt: int, url: str, path: str, model: Any, headers: dict[str, str]
    ) -> RegularLegSpan:
        """The leg span of an attempt to the regular worker at ``url`` on ``path``; its
        ``traceparent`` is added to a copy of ``headers``."""
        attributes: dict[str, str] = {"pd.regular.url": url}
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
        self.span.set_attributes(attributes)
        if attempt > 1:
            self.retries += 1
        span = leg_span(self._tracer, self._context, "regular", url + path, attempt)
        return RegularLegSpan(span, propagated(headers, span))

    def finish(self, status: int) -> None:
        """End the span with the status the client got (499: it went away)."""
        span = self.span
        span.set_attributes({"http.response.status_code": status, "pd.retries": self.retries})
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


class ExchangeSpan:
    """The attempts of one exchange (the request, or one sample of a request with ``n > 1``),
    numbered from 1, their legs in the request's span."""

    __slots__ = ("_request", "attempts")

    def __init__(self, request: RequestSpan) -> None:
        self._request = request
        self.attempts = 0

    def attempt(
        self,
        prefill: str,
        decode: str,
        path: str,
        model: Any,
        headers: tuple[dict[str, str], dict[str, str]],
    ) -> LegSpans:
        """The leg spans of the next attempt, to ``prefill`` and ``decode`` (their urls) on
        ``path``; ``headers``: the prefill's and the decode's."""
        self.attempts += 1
        return self._request.legs(self.attempts, (prefill, decode), path, model, headers)

    def regular_attempt(
        self, url: str, path: str, model: Any, headers: dict[str, str]
    ) -> RegularLegSpan:
        """The leg span of the next attempt, to the regular worker at ``url``."""
        self.attempts += 1
        return self._request.regular_leg(self.attempts, url, path, model, headers)


class RegularLegSpan:
    """The one leg of an attempt to a regular worker, and the headers that carry it."""

    __slots__ = ("headers", "span")

    def __init__(self, span: Span, headers: dict[str, str]) -> None:
        self.span = span
        self.headers = headers

    def ended(self, error: BaseException | None, relayed: bool | None) -> None:
        """The attempt ended: with ``error`` (None: answered); ``relayed``: whether a stream
        reached its end (None: not a stream)."""
        attributes: dict[str, str | int] = {"pd.leg.outcome": OK}
        if isinstance(error, asyncio.CancelledError):
            attributes["pd.leg.outcome"] = CANCELLED
        elif error is not None:
            attributes["pd.leg.outcome"] = FAILED
            attributes["error.type"] = getattr(error, "kind", type(error).__name__)
            status = getattr(error, "status", None)
            if isinstance(status, int):
                attributes["http.response.status_code"] = status
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        elif relayed is False:
            attributes["pd.leg.outcome"] = INCOMPLETE
        self.span.set_attributes(attributes)
        self.span.end()


class LegSpans:
    """The prefill and the decode leg spans of one attempt, and the headers that carry them
    to the workers."""

    __slots__ = ("decode", "decode_headers", "prefill", "prefill_headers")

    def __init__(
        self,
        tracer: trace.Tracer,
        parent: Context,
        attempt: int,
        urls: tuple[str, str],
        path: str,
        headers: tuple[dict[str, str], dict[str, str]],
    ) -> None:
        self.prefill = leg_span(tracer, parent, "prefill", urls[0] + path, attempt)
        self.decode = leg_span(tracer, parent, "decode", urls[1] + path, attempt)
        self.prefill_headers = propagated(headers[0], self.prefill)
        self.decode_headers = propagated(headers[1], self.decode)

    def prefill_ended(self, task: asyncio.Task) -> None:
        """The prefill leg's task ended (a done callback)."""
        end_leg(self.prefill, (task,), None)

    def decode_ended(self, tasks: Sequence[asyncio.Task | None], relayed: bool | None) -> None:
        """The decode leg ended: ``tasks`` are what it ran (the request, and for a stream its
        first event); ``relayed``: whether a stream reached its end (None: not a stream)."""
        end_leg(self.decode, tasks, relayed)


def leg_span(tracer: trace.Tracer, parent: Context, role: str, url: str, attempt: int) -> Span:
    return tracer.start_span(
        f"{role} leg",
        context=parent,
        kind=SpanKind.CLIENT,
        attributes={
            "pd.role": role,
            "http.request.method": "POST",
            "url.full": url,
            "pd.attempt": attempt,
        },
    )


def propagated(headers: dict[str, str], span: Span) -> dict[str, str]:
    """``headers`` plus the W3C ``traceparent`` naming ``span`` as the parent."""
    out = dict(headers)
    PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
    return out


def end_leg(span: Span, tasks: Sequence[asyncio.Task | None], relayed: bool | None) -> None:
    """End a leg span with its outcome: the first of ``tasks`` that failed says why; a stream
    not ``relayed`` to its end is incomplete."""
    attributes: dict[str, str | int] = {"pd.leg.outcome": OK}
    for task in tasks:
        if task is None or not task.done():
            continue
        if task.cancelled():
            attributes["pd.leg.outcome"] = CANCELLED
            continue
        error = task.exception()
        result = task.result() if error is None else error
        status = getattr(result, "status", None)
        if isinstance(status, int):
            attributes["http.response.status_code"] = status
        if error is not None:
            attributes["pd.leg.outcome"] = FAILED
            attributes["error.type"] = getattr(error, "kind", type(error).__name__)
            span.set_status(Status(StatusCode.ERROR, str(error)))
            break
    if attributes["pd.leg.outcome"] == OK and relayed is False:
        attributes["pd.leg.outcome"] = INCOMPLETE
    span.set_attributes(attributes)
    span.end()
