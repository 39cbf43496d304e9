"""What the request path needs, and nothing more: :class:`PathCollaborators`.

The handlers of the generation endpoints reach their collaborators through it: the pools to
pick from (:class:`Pools`: the control side's last snapshot,
:class:`pd_router.dataplane.routing.snapshot.SnapshotPools`), the legs, the admission of
requests, the latency sink the autopilot reads from (the data plane's reports), the request
metrics and how to tell a worker to abort. Nothing in the data plane sees the router's control side.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pd_router.dataplane.front.concurrency import RequestAdmission
from pd_router.dataplane.legs.leg import Legs
from pd_router.dataplane.routing.policies import Policy
from pd_router.dataplane.routing.retry import RetryConfig
from pd_router.dataplane.routing.target import Target
from pd_router.errors import NoWorkers
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role


class Pools(Protocol):
    def pick(
        self, role: Role, avoid: Iterable[Target] = (), prompt: Callable[[], str] | None = None
    ) -> Target:
        """A worker of ``role`` by its pool's policy (NoWorkers if none)."""
        ...

    def acquire(self, target: Target) -> None: ...
    def release(self, target: Target) -> None: ...

    def suspect(self, target: Target) -> None:
        """The worker answered for the other role: have its role read now."""
        ...


def choose(
    role: Role,
    workers: Sequence[Target],
    avoid: Iterable[Target],
    policy: Policy,
    prompt: Callable[[], str] | None,
    count_refusal: Callable[[str], None],
) -> Target:
    """The pick of a pool, wherever its workers come from: one of ``workers`` (the selectable
    ones, or when none is, those kept out only by their circuits), preferring those not in
    ``avoid`` (they already failed this request), chosen by ``policy``; NoWorkers (and a
    refusal counted) if there is none. ``prompt`` is called only for a policy that needs it."""
    if avoid and len(workers) > 1:
        avoided = set(avoid)
        fresh = [w for w in workers if w not in avoided]
        if fresh:
            workers = fresh
    if not workers:
        count_refusal(role.value)
        raise NoWorkers(f"no available {role.value} worker (none active, healthy and closed)")
    if policy.needs_prompt and prompt is not None:
        return policy.select(workers, prompt())
    return policy.select(workers)


class LatencySink(Protocol):
    def observe_ttft(self, seconds: float, prefilled_after: float | None) -> None: ...
    def observe_stream(self, seconds_after_first: float, events: int) -> None: ...
    def count_refusal(self, role: str) -> None: ...


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
