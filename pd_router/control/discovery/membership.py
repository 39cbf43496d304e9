"""Discovered workers join and leave through the cluster, as the admin API's do.

A provider (Kubernetes, a manifest file) says what it wants under a key of its own (a pod's
port, a manifest entry): a :class:`DiscoveredWorker` or nothing. :class:`Membership` brings the
registry there one key at a time, in order: a worker joins with ``cluster.add_worker`` and one
probe (``POST /workers``), leaves with ``cluster.begin_removal`` and the wait for its in-flight
requests (``DELETE /workers``), so on every replica it stops taking requests at once and what
it runs finishes. A worker that a conversion holds is let go first: this router's conversion is
aborted while it still drains, and a switch already called is waited for. The role a provider
proposes only places a new worker; the health probes then keep it in its live role.

A url already registered (given on the command line, added by an operator, or by another
replica's discovery) is taken as the one discovered there: its origin is recorded and it
leaves when its pod or entry goes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pd_protocol.backoff import Backoff
from pd_router.control.cluster.local import Cluster
from pd_router.control.errors import ClusterUnavailable
from pd_router.control.workers import (
    DuplicateWorker,
    Origin,
    Role,
    UnknownWorker,
    Worker,
    WorkerConverting,
    WorkerRegistry,
    WorkerRemoving,
    WorkerState,
)
from pd_router.metrics import RouterMetrics

log = logging.getLogger("pd_router.discovery")

RETRY_SECS = 0.2
RETRY_MAX_SECS = 5.0
PEER_CONVERSION_POLL_SECS = 0.1


@dataclass(frozen=True)
class DiscoveredWorker:
    """A worker a provider wants registered: ``role`` is its proposal (None: read the live
    role first), ``bootstrap_port`` None reads it from the worker."""

    url: str
    role: Role | None
    bootstrap_port: int | None
    origin: Origin


class Membership:
    """The workers one provider wants, brought into the registry key by key, in order."""

    def __init__(
        self,
        provider: str,
        registry: WorkerRegistry,
        cluster: Cluster,
        metrics: RouterMetrics,
        *,
        probe: Callable[[Worker], Awaitable[Any]],
        remove: Callable[[Worker], Awaitable[Any]],
        live_role: Callable[[str], Awaitable[Role | None]],
        let_go: Callable[[Worker], Awaitable[bool]],
    ) -> None:
        self._provider = provider
        self._registry = registry
        self._cluster = cluster
        self._probe = probe
        self._remove = remove
        self._live_role = live_role
        # Ends this router's conversion of a leaving worker; False when another replica's
        # conversion holds it.
        self._let_go = let_go
        self._discovered = metrics.discovery_discovered_total.labels(provider)
        self._removed = metrics.discovery_removed_total
        self._wanted: dict[str, tuple[DiscoveredWorker | None, str]] = {}
        self._joined: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def want(self, key: str, target: DiscoveredWorker | None, reason: str = "") -> None:
        """What ``key`` should be now: ``target`` registered, or (None) nothing, for
        ``reason`` (counted on removal)."""
        if target is None and key not in self._joined and key not in self._tasks:
            self._wanted.pop(key, None)
            return
        self._wanted[key] = (target, reason)
        if key not in self._tasks:
            task = asyncio.get_running_loop().create_task(self._reconcile(key))
            self._tasks[key] = task

    def keys(self) -> set[str]:
        """Every key wanted or still registered."""
        return set(self._wanted) | set(self._joined)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _reconcile(self, key: str) -> None:
        """Step ``key`` towards what is wanted, re-reading it after every wait, until the two
        agree (nothing awaited between the last reading and the return)."""
        backoff = Backoff(RETRY_SECS, RETRY_MAX_SECS)
        try:
            while True:
                target, reason = self._wanted.get(key, (None, ""))
                url = self._joined.get(key)
                try:
                    if url is not None and (target is None or target.url != url):
                        await self._leave(url, reason or "replaced")
                        del self._joined[key]
                        continue
                    if target is not None and url is None:
                        await self._join(target)
                        self._joined[key] = target.url
                        continue
                except Exception:
                    log.exception("discovery: %s failed; trying again in %.1fs", key, backoff.secs)
                    await backoff.sleep()
                    continue
                if target is None:
                    self._wanted.pop(key, None)
                    return
                try:
                    worker = self._registry.get(target.url)
                except UnknownWorker:
                    del self._joined[key]  # removed by someone else: join again
                    continue
                self._registry.set_origin(worker, target.origin)
                return
        finally:
            self._tasks.pop(key, None)

    async def _join(self, target: DiscoveredWorker) -> None:
        role = target.role or await self._live_role(target.url) or Role.DECODE
        while True:
            try:
                worker = await self._cluster.add_worker(target.url, role, target.bootstrap_port)
            except DuplicateWorker:
                worker = self._registry.get(target.url)
                self._registry.set_origin(worker, target.origin)
                log.info("discovered %s (%s), already registered", target.url, target.origin)
                return
            except (WorkerRemoving, ClusterUnavailable) as exc:
                log.info("discovery: %s cannot join yet: %s", target.url, exc)
                await asyncio.sleep(RETRY_SECS)
                continue
            break
        self._registry.set_origin(worker, target.origin)
        if target.origin.model_id:
            self._registry.set_model(worker, target.origin.model_id)
        self._discovered.inc()
        log.info(
            "discovered %s as %s (%s)", target.url, role.value, target.origin,
            extra={"worker": target.url, **target.origin.as_dict()},
        )  # fmt: skip
        await self._probe(worker)

    async def _leave(self, url: str, reason: str) -> None:
        while True:
            try:
                worker = self._registry.get(url)
                empties = self._empties(worker)
                await self._cluster.begin_removal(worker)
            except (UnknownWorker, WorkerRemoving):
                return
            except WorkerConverting:
                if not await self._let_go(worker):
                    await asyncio.sleep(PEER_CONVERSION_POLL_SECS)
                continue
            except ClusterUnavailable as exc:
                log.info("discovery: %s cannot leave yet: %s", url, exc)
                await asyncio.sleep(RETRY_SECS)
                continue
            break
        self._removed.labels(self._provider, reason).inc()
        fields = {"worker": url, "reason": reason}
        if empties:
            role = worker.role.value
            log.warning("%s leaves: %s; no healthy %s worker is left", url, reason, role,
                        extra=fields)  # fmt: skip
        else:
            log.info("%s leaves: %s", url, reason, extra=fields)
        await self._remove(worker)

    def _empties(self, worker: Worker) -> bool:
        """Whether ``worker`` leaving takes its pool's last active healthy worker (a warning:
        requests of that role get 503 until another joins)."""
        return (
            worker.state is WorkerState.ACTIVE
            and self._registry.active_healthy_count(worker.role, excluding=worker) == 0
        )
