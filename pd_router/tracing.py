"""OpenTelemetry traces, off by default: the ``[tracing]`` section, where spans go, and the
span trees the control side hands over.

Nothing here imports OpenTelemetry. With tracing off (the default) no module of it is loaded
and the request path holds ``None`` where a tracer would be: a few ``is None`` tests per
request are all it costs. With ``[tracing] enabled`` (``--enable-trace``, as smg and
sglang-router name it) :func:`pd_router.runtime.tracing.start_tracing` loads
:mod:`pd_router.otel_tracing`, which needs the ``otel`` extra (``pip install
'pd-router[otel]'``), and every process that serves or converts (the router, and each
data-plane process of ``--workers N``) exports its own spans over OTLP/HTTP to ``endpoint``.

Spans the control side records after the fact (a conversion, its phases) are handed over as
:class:`SpanRecord` trees, so the control side builds them without importing OpenTelemetry
either.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# OTLP/HTTP's path for traces, added to an endpoint given without one (smg's shape: host:port).
TRACES_PATH = "/v1/traces"
# The OTLP/gRPC port: an endpoint on it most likely is a collector's gRPC receiver, which the
# OTLP/HTTP exporter cannot talk to.
GRPC_PORT = 4317


@dataclass(frozen=True)
class TracingConfig:
    """``[tracing]``: whether to export spans, where (an OTLP/HTTP collector: ``host:port`` or a
    URL; a URL without a path gets ``/v1/traces``), under which service name, and the fraction
    of new traces to sample (a request that comes with a ``traceparent`` follows its caller's
    sampling decision)."""

    enabled: bool = False
    endpoint: str = "http://localhost:4318"
    service_name: str = "pd-router"
    sample_ratio: float = 1.0


def traces_url(endpoint: str) -> str:
    """The URL spans are POSTed to: ``host:port`` becomes ``http://host:port/v1/traces``, and
    a URL without a path gets ``/v1/traces``."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    parts = urlsplit(url)
    if parts.path in ("", "/"):
        url = url.rstrip("/") + TRACES_PATH
    return url


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` cannot be exported to (not an http(s) URL with a host), else None."""
    parts = urlsplit(traces_url(endpoint))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"not host:port or an http(s) URL: {endpoint!r}"
    try:
        parts.port  # noqa: B018 (a port that is not a number raises)
    except ValueError:
        return f"not a port number in {endpoint!r}"
    return None


def grpc_port_warning(endpoint: str) -> str | None:
    """A warning for an endpoint on the OTLP/gRPC port (smg exports over gRPC, pd-router over
    HTTP: a command line written for smg points at the collector's 4317), else None."""
    if urlsplit(traces_url(endpoint)).port != GRPC_PORT:
        return None
    return (
        f"tracing.endpoint {endpoint} is on port {GRPC_PORT}, OTLP/gRPC's; pd-router exports "
        "OTLP/HTTP (a collector's port 4318)"
    )


def otel_installed() -> bool:
    """Whether the ``otel`` extra is installed (looked up, not imported)."""
    return all(
        importlib.util.find_spec(name) is not None
        for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
    )


@dataclass(frozen=True)
class SpanRecord:
    """A span that already ended, and its children: ``start``/``end`` in wall-clock seconds
    (``time.time()``); ``error`` says why it failed (None: it did not)."""

    name: str
    start: float
    end: float
    attributes: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    error: str | None = None
    children: tuple[SpanRecord, ...] = ()


# Where the control side hands a finished span tree (a conversion) to be exported.
RecordSpan = Callable[[SpanRecord], None]
