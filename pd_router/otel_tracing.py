"""Spans through OpenTelemetry's SDK, exported over OTLP/HTTP (the ``otel`` extra; loaded by
:func:`pd_router.tracing.start_tracing` only when tracing is on).

One :class:`Tracing` per process: its own tracer provider and batch exporter (a data-plane
process of ``--workers N`` exports its own spans). Spans are exported in batches of up to 64
every 0.5 s, as smg does, from the SDK's exporter thread; the event loop only starts and ends
spans. Contexts are passed explicitly (never the SDK's current span), so nothing leaks from one
request to another.

The request path: a server span per client request (:class:`RequestSpan`), continuing the
client's ``traceparent`` when it sent one; per attempt a client span for each leg
(:class:`LegSpans`) whose W3C ``traceparent`` goes to that leg's worker. A failed leg is
recognised by the exception it ended with: the request path's ``LegFailed`` carries ``kind``
and ``status``.
"""

from __future__ import annotations

import asyncio
import os
import socket
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

# smg's batch settings: spans reach the collector within about half a second.
SCHEDULE_DELAY_MILLIS = 500
MAX_EXPORT_BATCH_SIZE = 64
EXPORT_TIMEOUT_SECS = 10.0
PROPAGATOR = TraceContextTextMapPropagator()
# What a leg span says of how its leg ended (attribute pd.leg.outcome); only "failed" is an
# error: "cancelled" and "incomplete" (a stream cut short, the client gone) follow from
# something else.
OK, FAILED, CANCELLED, INCOMPLETE = "ok", "failed", "cancelled", "incomplete"


class Tracing:
    """This process's tracer and exporter."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("pd_router")

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
            resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
        )
        exporter = OTLPSpanExporter(
            endpoint=traces_url(config.endpoint), timeout=EXPORT_TIMEOUT_SECS
        )
        provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=SCHEDULE_DELAY_MILLIS,
                max_export_batch_size=MAX_EXPORT_BATCH_SIZE,
            )
        )
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is left and stop the exporter."""
        self.provider.shutdown()

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

    __slots__ = ("_context", "_tracer", "attempts", "span")

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span
        self._context = trace.set_span_in_context(span)
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
        ``path``; ``headers`` are the prefill's and the decode's, to which the legs'
        ``traceparent`` is added (in copies)."""
        self.attempts += 1
        span = self.span
        span.set_attribute("pd.prefill.url", prefill)
        span.set_attribute("pd.decode.url", decode)
        if isinstance(model, str):
            span.set_attribute("gen_ai.request.model", model)
        urls = prefill, decode
        return LegSpans(self._tracer, self._context, self.attempts, urls, path, headers)

    def finish(self, status: int) -> None:
        """End the span with the status the client got (499: it went away)."""
        span = self.span
        span.set_attribute("http.response.status_code", status)
        span.set_attribute("pd.retries", max(0, self.attempts - 1))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()


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
    outcome = OK
    for task in tasks:
        if task is None or not task.done():
            continue
        if task.cancelled():
            outcome = CANCELLED
            continue
        error = task.exception()
        if error is not None:
            outcome = FAILED
            status = getattr(error, "status", None)
            if isinstance(status, int):
                span.set_attribute("http.response.status_code", status)
            span.set_attribute("error.type", getattr(error, "kind", type(error).__name__))
            span.set_status(Status(StatusCode.ERROR, str(error)))
            break
        status = getattr(task.result(), "status", None)
        if isinstance(status, int):
            span.set_attribute("http.response.status_code", status)
    if outcome == OK and relayed is False:
        outcome = INCOMPLETE
    span.set_attribute("pd.leg.outcome", outcome)
    span.end()
