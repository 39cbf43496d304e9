"""The pools of a one-process router: the registry's own workers, each pool picked by its
policy. The request path reaches them as :class:`pd_router.dataplane.path.Pools`; a data plane
of a multi-process router has :class:`pd_router.dataplane.snapshot.SnapshotPools` instead."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pd_router.control.health import HealthMonitor
from pd_router.control.latency import LatencyRecorder
from pd_router.control.workers import Worker, WorkerRegistry, WorkerState
from pd_router.dataplane.path import choose
from pd_router.dataplane.policies import Policy
from pd_router.roles import Role


class RegistryPools:
    """Picks from the registry; counts in flight on its workers (the registry's own methods,
    bound: no extra call on the hot path)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policies: dict[Role, Policy],
        health: HealthMonitor,
        latency: LatencyRecorder,
    ) -> None:
        self._registry = registry
        self.policies = policies
        self._latency = latency
        self.acquire = registry.acquire
        self.release = registry.release
        self.suspect = health.suspect

    def pick(
        self,
        role: Role,
        avoid: Iterable[Worker] = (),
        prompt: Callable[[], str] | None = None,
    ) -> Worker:
        """A selectable worker of ``role`` chosen by its pool's policy, preferring workers not
        in ``avoid`` (the ones that already failed this request). NoWorkers if none.
        ``prompt`` gives the request's prompt key; it is called only for a policy that needs
        it, so the others cost nothing."""
        return choose(
            role,
            self._registry.selectable(role) or self.circuit_panic_pool(role, avoid),
            avoid,
            self.policies[role],
            prompt,
            self._latency.count_refusal,
        )

    def circuit_panic_pool(self, role: Role, avoid: Iterable[Worker] = ()) -> list[Worker]:
        """The ACTIVE, healthy workers of ``role`` not in ``avoid``, for when none is
        selectable: each is then kept out only by its circuit (open, or its half-open trial
        taken). A circuit steers traffic to other workers, and there are none; answering 503
        would make a whole burst fail after an outage the probes saw end (see
        :mod:`pd_router.control.circuit`). A worker that already failed this request is not
        tried again through its open circuit."""
        avoided = set(avoid)
        return [
            w
            for w in self._registry.in_role(role, (WorkerState.ACTIVE,))
            if w.healthy and w.admitting and w not in avoided
        ]
