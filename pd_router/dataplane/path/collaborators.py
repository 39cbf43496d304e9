"""What the request path needs, and nothing more: :class:`PathCollaborators`.

The handlers of the generation endpoints reach their collaborators through it: the pools to
pick from (:class:`~pd_router.dataplane.routing.pools.Pools`: the control side's last snapshot,
:class:`~pd_router.dataplane.routing.snapshot.SnapshotPools`), the legs, the admission of
requests, the latency sink the autopilot reads from (the data plane's reports), the request
metrics, how to tell a worker to abort, and the tracer (None: tracing off). Nothing in the data
plane sees the router's control side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pd_router.dataplane.front.concurrency import RequestAdmission
from pd_router.dataplane.legs.leg import Legs
from pd_router.dataplane.routing.pools import Pools
from pd_router.dataplane.routing.retry import RetryConfig
from pd_router.dataplane.routing.target import Target
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role

if TYPE_CHECKING:
    from pd_router.otel_tracing import Tracing


class LatencySink(Protocol):
    def observe_ttft(self, seconds: float, prefilled_after: float | None, model: str) -> None: ...
    def observe_stream(self, seconds_after_first: float, events: int, model: str) -> None: ...
    def count_refusal(self, role: str, model: str) -> None: ...


class RequestMetrics:
    """The request path's metrics, their labelled children cached (no label lookup per
    request)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self._requests: dict[tuple[str, int], Any] = {}
        self._durations: dict[str, Any] = {}
        self._upstream_errors: dict[tuple[str, str], Any] = {}

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        counter = self._requests.get(key)
        if counter is None:
            counter = self.metrics.requests_total.labels(endpoint, str(status))
            self._requests[key] = counter
        counter.inc()
        histogram = self._durations.get(endpoint)
        if histogram is None:
            histogram = self.metrics.request_duration_seconds.labels(endpoint)
            self._durations[endpoint] = histogram
        histogram.observe(seconds)

    def count_retry(self) -> None:
        self.metrics.retries_total.inc()

    def observe_ttft(self, seconds: float) -> None:
        self.metrics.ttft_seconds.observe(seconds)

    def count_upstream_error(self, role: Role, kind: str) -> None:
        key = (role.value, kind)
        counter = self._upstream_errors.get(key)
        if counter is None:
            counter = self.metrics.upstream_errors_total.labels(role.value, kind)
            self._upstream_errors[key] = counter
        counter.inc()


@dataclass(slots=True)
class PathCollaborators:
    """The collaborators of the generation handlers."""

    pools: Pools
    legs: Legs
    leg_headers: dict[Role, dict[str, str]]
    retry: RetryConfig
    admission: RequestAdmission
    latency: LatencySink
    metrics: RequestMetrics
    # Fire-and-forget ``/abort_request`` of these rids to a worker.
    abort: Callable[[Target, list[str]], object]
    # The spans of requests and legs (None: tracing off, and nothing of OpenTelemetry loaded).
    tracer: Tracing | None = None
