"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in protobuf (gzip or not), decoded with opentelemetry-proto, as a
collector's OTLP/HTTP receiver takes it.

    async with otlp_receiver() as receiver:
        ... a router with [tracing] endpoint = receiver.endpoint ...
        spans = await receiver.wait_for(lambda spans: ..., within=10)

Needs the ``otel`` extra (opentelemetry-proto comes with its exporter); tests import it through
:func:`pytest.importorskip` so they skip, saying why, without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

PROTOBUF = "application/x-protobuf"
# Span kinds as OTLP numbers them.
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as exported: ids in hex, the parent's "" for a root."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    attributes: dict[str, Any]
    error: bool
    status_message: str
    start_ns: int
    end_ns: int
    resource: dict[str, Any] = field(default_factory=dict)


def value(any_value: AnyValue) -> Any:
    which = any_value.WhichOneof("value")
    return None if which is None else getattr(any_value, which)


def decoded(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        kind=KINDS.get(span.kind, str(span.kind)),
                        attributes={a.key: value(a.value) for a in span.attributes},
                        error=span.status.code == 2,
                        status_message=span.status.message,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        resource=resource,
                    )
                )
    return spans


class OtlpReceiver:
    """What the receiver got: every span, and every export call."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.endpoint = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.exports += 1
        self.spans.extend(decoded(body))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type=PROTOBUF
        )

    async def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], within: float = 10.0
    ) -> list[ReceivedSpan]:
        """The spans received once ``condition`` holds of them; AssertionError naming what
        came after ``within`` seconds."""
        deadline = time.monotonic() + within
        while not condition(self.spans):
            if time.monotonic() > deadline:
                names = [(s.name, s.trace_id[:8]) for s in self.spans]
                raise AssertionError(f"spans received within {within} s: {names}")
            await asyncio.sleep(0.05)
        return list(self.spans)


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    """An OTLP/HTTP receiver on a free loopback port (``receiver.endpoint``: host:port)."""
    receiver = OtlpReceiver()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", receiver.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    receiver.endpoint = f"{host}:{port}"
    try:
        yield receiver
    finally:
        await runner.cleanup()
