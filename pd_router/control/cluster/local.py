"""What the router asks of its cluster, and the answers of a router that is alone.

The conversion runner, the admin API and the autopilot call these at the points where several
replicas must agree (claiming a worker, draining it everywhere, publishing its new role, adding
and removing workers, electing who runs the autopilot). A single router has no one to agree
with: :class:`LocalCluster` answers at once.
:class:`pd_router.control.cluster.etcd.EtcdCluster` answers through etcd.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from pd_router.control.workers import Role, Worker, WorkerRegistry, WorkerState


class ConversionTaken(Exception):
    """Another replica settled the worker a conversion of this one held: this replica's lease
    lapsed (a freeze, a long etcd outage) and its lock went with it. The conversion must let
    the worker go without a switch: the settled record stands."""


class Cluster(Protocol):
    enabled: bool
    replica_id: str

    async def start(self) -> None:
        """Join the cluster (a router starting)."""

    async def stop(self) -> None:
        """Leave it: what this replica held (leadership, conversion locks) is released."""

    def is_leader(self) -> bool:
        """Whether this replica runs the autopilot."""

    def conversion_id(self, number: int) -> str:
        """The cluster-wide id of this replica's ``number``-th conversion."""

    async def catch_up(self) -> None:
        """Until this replica has applied everything the cluster agreed so far (a conversion
        checks the pools on that, not on a view a few milliseconds behind another replica)."""

    async def claim(
        self, worker: Worker, conversion_id: str, to_role: Role, recheck: Callable[[], None]
    ) -> None:
        """Hold ``worker`` for the conversion on every replica; raises ConversionRefused (409)
        or ClusterUnavailable (503) with nothing changed. ``recheck`` raises ConversionRefused
        when the pools, as they are now, no longer allow the conversion (called when another
        replica changed them since the caller's check)."""

    async def mark_switching(self, worker: Worker, conversion_id: str) -> bool:
        """The conversion calls the switch now (shown on every replica); False when the
        conversion no longer holds the worker's shared record (another replica settled it
        after this one's lease expired): the switch must not be called."""

    async def wait_peers_drained(
        self,
        worker: Worker,
        conversion_id: str,
        abort: asyncio.Event,
        deadline: float,
        waiting: Callable[[list[str]], None],
    ) -> list[str]:
        """Wait until every other live replica has no request in flight on ``worker`` (or
        ``abort`` is set, or the monotonic ``deadline`` passed); the replicas not drained.
        ``waiting`` is told the replicas still waited for whenever they change.
        ConversionTaken when another replica settled the worker meanwhile."""

    async def release(
        self,
        worker: Worker,
        conversion_id: str,
        state: WorkerState,
        role: Role,
        bootstrap_port: int | None,
    ) -> None:
        """Publish how the conversion let the worker go, before this replica routes to it.
        Never raises: what cannot be published now is published when etcd is back."""

    def finished(self, worker: Worker, conversion_id: str) -> None:
        """The conversion let the worker go in this replica's registry too."""

    async def add_worker(self, url: str, role: Role, bootstrap_port: int | None) -> Worker:
        """Register a new worker (unhealthy until probed) on every replica; this replica's
        Worker. DuplicateWorker, WorkerRemoving, ClusterUnavailable."""

    async def begin_removal(self, worker: Worker) -> None:
        """Every replica stops routing to ``worker`` (REMOVING); WorkerConverting,
        WorkerRemoving, ClusterUnavailable with nothing changed."""

    async def end_removal(self, worker: Worker) -> None:
        """This replica's removal is over: the worker leaves the shared record."""

    def as_dict(self) -> dict[str, Any]:
        """What ``GET /cluster`` shows."""


class LocalCluster:
    """A router alone: its registry is the whole truth, every step is agreed at once."""

    enabled = False
    replica_id = ""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def is_leader(self) -> bool:
        return True

    def conversion_id(self, number: int) -> str:
        return f"c{number}"

    async def catch_up(self) -> None:
        return None

    async def claim(
        self, worker: Worker, conversion_id: str, to_role: Role, recheck: Callable[[], None]
    ) -> None:
        return None

    async def mark_switching(self, worker: Worker, conversion_id: str) -> bool:
        return True

    async def wait_peers_drained(
        self,
        worker: Worker,
        conversion_id: str,
        abort: asyncio.Event,
        deadline: float,
        waiting: Callable[[list[str]], None],
    ) -> list[str]:
        return []

    async def release(
        self,
        worker: Worker,
        conversion_id: str,
        state: WorkerState,
        role: Role,
        bootstrap_port: int | None,
    ) -> None:
        return None

    def finished(self, worker: Worker, conversion_id: str) -> None:
        return None

    async def add_worker(self, url: str, role: Role, bootstrap_port: int | None) -> Worker:
        return self._registry.add(url, role, bootstrap_port, healthy=False)

    async def begin_removal(self, worker: Worker) -> None:
        self._registry.begin_removal(worker)

    async def end_removal(self, worker: Worker) -> None:
        return None

    def as_dict(self) -> dict[str, Any]:
        return {"enabled": False}
