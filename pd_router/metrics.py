"""Every Prometheus metric of the router, defined in one place.

Names are stable: the Grafana dashboard and the alert rules in ``configs/`` are built on them.
Each router owns its own ``CollectorRegistry`` (no module-level global), so several routers can
live in one process, as they do in tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample as PromSample

PREFIX = "pd_router_"

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0, 120.0, 300.0, 600.0)  # fmt: skip


class RouterMetrics:
    """The router's metrics, registered on a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests_total = Counter(
            PREFIX + "requests_total", "Client requests by endpoint and HTTP status.",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.request_duration_seconds = Histogram(
            PREFIX + "request_duration_seconds", "End-to-end request latency seen by the router.",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft_seconds = Histogram(
            PREFIX + "ttft_seconds", "Request arrival to first byte sent to the client.",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream_errors_total = Counter(
            PREFIX + "upstream_errors_total", "Failed upstream legs by role and kind of failure.",
            ["role", "kind"], registry=r,
        )  # fmt: skip
        self.retries_total = Counter(
            PREFIX + "retries_total", "Requests retried with a new (prefill, decode) pair.",
            registry=r,
        )  # fmt: skip
        self.client_connections_moved_total = Counter(
            PREFIX + "client_connections_moved_total",
            "Client connections closed after an answer so that the data planes hold even shares.",
            registry=r,
        )
        self.worker_inflight = Gauge(
            PREFIX + "worker_inflight", "Requests the router has in flight on a worker.",
            ["worker", "role"], registry=r,
        )  # fmt: skip
        self.worker_healthy = Gauge(
            PREFIX + "worker_healthy", "1 when the worker passes health checks.",
            ["worker"], registry=r,
        )  # fmt: skip
        self.worker_state = Gauge(
            PREFIX + "worker_state", "1 for the worker's current state, 0 for the others.",
            ["worker", "state"], registry=r,
        )  # fmt: skip
        self.pool_size = Gauge(
            PREFIX + "pool_size", "ACTIVE workers per role (healthy or not).",
            ["role"], registry=r,
        )  # fmt: skip
        self.model_pool_size = Gauge(
            PREFIX + "model_pool_size", "ACTIVE workers per model and role (healthy or not).",
            ["model", "role"], registry=r,
        )  # fmt: skip
        self.worker_model = Gauge(
            PREFIX + "worker_model", "1 for the model each worker serves (to join on worker).",
            ["worker", "model"], registry=r,
        )  # fmt: skip
        self.circuit_state = Gauge(
            PREFIX + "circuit_state", "Circuit breaker state: 0 closed, 1 open, 2 half-open.",
            ["worker"], registry=r,
        )  # fmt: skip
        self.admission_queue_depth = Gauge(
            PREFIX + "admission_queue_depth",
            "Generation requests waiting for a slot (max_concurrent_requests).", registry=r,
        )  # fmt: skip
        self.admission_rejections_total = Counter(
            PREFIX + "admission_rejections_total",
            "Generation requests refused with 429: queue_full, queue_timeout, rate_limited.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.conversions_total = Counter(
            PREFIX + "conversions_total", "Role conversions by direction and outcome.",
            ["from_role", "to_role", "outcome"], registry=r,
        )  # fmt: skip
        self.conversion_phase_seconds = Histogram(
            PREFIX + "conversion_phase_seconds",
            "Duration of conversion phases (drain, switch, verify, total).",
            ["phase"], buckets=PHASE_BUCKETS, registry=r,
        )  # fmt: skip
        self.autopilot_decisions_total = Counter(
            PREFIX + "autopilot_decisions_total", "Autopilot decisions by action.",
            ["action"], registry=r,
        )  # fmt: skip
        self.autopilot_desired_workers = Gauge(
            PREFIX + "autopilot_desired_workers",
            "Workers per role the autopilot's last decision for a model's pools aims for.",
            ["role", "model"], registry=r,
        )  # fmt: skip
        self.cluster_etcd_up = Gauge(
            PREFIX + "cluster_etcd_up",
            "1 while this replica reaches its cluster's etcd (always 0 without a cluster).",
            registry=r,
        )  # fmt: skip
        self.cluster_replicas = Gauge(
            PREFIX + "cluster_replicas", "Live router replicas of the cluster, as last seen.",
            registry=r,
        )  # fmt: skip
        self.cluster_leader = Gauge(
            PREFIX + "cluster_leader", "1 on the replica whose autopilot runs.", registry=r,
        )  # fmt: skip
        self.cluster_etcd_errors_total = Counter(
            PREFIX + "cluster_etcd_errors_total", "etcd calls that failed, by operation.",
            ["operation"], registry=r,
        )  # fmt: skip
        self.cluster_unregistered_workers = Gauge(
            PREFIX + "cluster_unregistered_workers",
            "Workers this replica routes to while the cluster holds no record of them (their "
            "lease expired: a grace period, or the last healthy worker of a pool).",
            registry=r,
        )
        self.discovery_discovered_total = Counter(
            PREFIX + "discovery_discovered_total",
            "Workers discovery registered (a Ready pod's port, a manifest entry), by provider.",
            ["provider"], registry=r,
        )  # fmt: skip
        self.discovery_removed_total = Counter(
            PREFIX + "discovery_removed_total",
            "Discovered workers removed, by provider and reason (not_ready, not_running, "
            "terminating, deleted, unselected, unlisted, replaced).",
            ["provider", "reason"], registry=r,
        )  # fmt: skip
        self.discovery_label_patches_total = Counter(
            PREFIX + "discovery_label_patches_total",
            "Pod role label patches: converted, repaired, forbidden (no RBAC patch), failed.",
            ["outcome"], registry=r,
        )  # fmt: skip

    def forget_worker(
        self, worker: str, role: str, states: Iterable[str], model: str | None = None
    ) -> None:
        """Drop a removed worker's labelled series (``worker_state`` for each of ``states``) so
        dashboards stop showing it."""
        for gauge, labels in (
            (self.worker_inflight, (worker, role)),
            (self.worker_healthy, (worker,)),
            (self.circuit_state, (worker,)),
            (self.worker_model, (worker, model)),
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        for state in states:
            with contextlib.suppress(KeyError):
                self.worker_state.remove(worker, state)

    def exposition(self, added: Iterable[Sample] = ()) -> tuple[bytes, str]:
        """The text exposition of every metric and its content type; ``added``: samples of
        other processes (:func:`samples`) added to these."""
        source: Any = self.registry
        if added:
            source = Merged(self.registry, added)
        return generate_latest(source), CONTENT_TYPE_LATEST


# One sample as it travels between processes: family name, family type, sample name, labels,
# value.
Sample = list


def samples(metrics: RouterMetrics) -> list[Sample]:
    """Every sample of ``metrics`` but the creation times, to add to another process's."""
    return [
        [family.name, family.type, s.name, s.labels, s.value]
        for family in metrics.registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    ]


class Merged:
    """A registry's metrics with other processes' samples added: a sample with the same name
    and labels is summed, one the registry lacks is appended to its family."""

    def __init__(self, registry: CollectorRegistry, added: Iterable[Sample]) -> None:
        self._registry = registry
        self._added: dict[str, dict[tuple[str, tuple], float]] = {}
        for family, _, name, labels, value in added:
            key = (name, tuple(sorted(labels.items())))
            into = self._added.setdefault(family, {})
            into[key] = into.get(key, 0.0) + value

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            added = dict(self._added.get(family.name, {}))
            merged = []
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                merged.append(s._replace(value=s.value + added.pop(key, 0.0)))
            merged += [
                PromSample(name, dict(labels), value) for (name, labels), value in added.items()
            ]
            family.samples = merged
            yield family
