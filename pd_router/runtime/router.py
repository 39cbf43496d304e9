"""The composition root: every control-side object of one router, built here in dependency order,
and the application that serves them.

:class:`Router` builds the configuration's parts one after the other, each from the ones built
before it: the metrics, the registry (with the configured workers), the health monitor, the
data planes' links, the two client sessions (the shared one for probes, fan-outs and aborts; the
control one, a connection per call, for role switches), the cluster (etcd, or alone), the
conversion manager, the autopilot, the load-report poller (for the pools whose policy routes by
what the workers report); its tracing first, when on (its conversions' spans, and those of the
data plane in its process). Nothing looks another part up later: a part that needs one
gets it when it is built. :attr:`Router.parts` is the one start/stop list: started in order,
stopped in reverse. :func:`build_app` puts the parts each handler needs under their keys
(:mod:`pd_router.api.keys`).

Worker lifecycle lives in the registry alone; a data plane learns of every change from the
next snapshot (a worker that stops taking requests gets its legs ended there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from pd_router.api import keys
from pd_router.api.server import application
from pd_router.config import RouterConfig
from pd_router.control.autopilot.controller import Autopilot
from pd_router.control.cluster.etcd import EtcdCluster
from pd_router.control.cluster.local import Cluster, LocalCluster
from pd_router.control.conversion.manager import ConversionManager
from pd_router.control.discovery.config import DiscoveryUnavailable
from pd_router.control.discovery.start import Started, start_discovery
from pd_router.control.health import HealthMonitor, WorkersUnreachable
from pd_router.control.latency import Latencies
from pd_router.control.load_poller import LoadPoller
from pd_router.control.publisher import DataPlanes
from pd_router.control.worker_control import (
    ControlError,
    WorkerControl,
    live_role,
    open_control_session,
)
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.dataplane.legs.setup import LegSetup, leg_setup
from pd_router.dataplane.path.collaborators import RequestMetrics
from pd_router.dataplane.routing.policies import canonical_policy_name
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from pd_router.runtime.tracing import start_tracing

log = logging.getLogger("pd_router")


@dataclass(frozen=True)
class Part:
    """One step of the router's start and its undoing; ``stop`` must also do nothing harmful
    for a part whose ``start`` did not run (a start that failed further on stops them all)."""

    name: str
    start: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]


async def nothing() -> None:
    """The start or stop of a part that has only the other."""


def worker_session(config: RouterConfig, setup: LegSetup) -> aiohttp.ClientSession:
    """The one shared client session (probes, fan-outs, aborts, etcd). It keeps no cookies: one
    client's worker cookies must not reach another client."""
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,
        keepalive_timeout=75,
        ttl_dns_cache=300,
        ssl=setup.worker_ssl if setup.worker_ssl is not None else True,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(
            total=config.request_timeout_secs, sock_connect=config.connect_timeout_secs
        ),
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        headers=setup.worker_headers,
    )


class Router:
    """The control side of one router, built in dependency order (in a running event loop: the
    client sessions belong to it)."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        # The request metrics' cached children and the legs' setup: the data plane of a
        # one-process router counts and sends with these (the control side calls workers with
        # the same headers and TLS).
        self.request_metrics = RequestMetrics(self.metrics)
        self.leg_setup = leg_setup(config, self.request_metrics.count_upstream_error)
        # Its spans: conversions, and the requests of the data plane in this process.
        self.tracing = start_tracing(config.tracing, "router")
        self.registry = WorkerRegistry(self.metrics, config.circuit)
        for role, specs in ((Role.PREFILL, config.prefill), (Role.DECODE, config.decode),
                            (Role.REGULAR, config.regular)):  # fmt: skip
            for spec in specs:
                self.registry.add(
                    spec.url, role, spec.bootstrap_port, healthy=False, model=spec.model
                )
        self.health = HealthMonitor(self.registry, config.health)
        self.latency = Latencies()
        self._background: set[asyncio.Task] = set()
        self.session = worker_session(config, self.leg_setup)
        self._control_session = open_control_session(self.leg_setup.worker_ssl)
        control = WorkerControl(
            self._control_session, self.registry, headers=self.leg_setup.worker_headers
        )
        self.dataplanes = DataPlanes(
            self.registry, self.health, self.latency, control.forget_prefill
        )
        self.cluster = self._cluster()
        self.conversions = ConversionManager(
            self.registry,
            self.metrics,
            control,
            self.health.report_down,
            min_prefill=config.conversion.min_prefill,
            min_decode=config.conversion.min_decode,
            max_concurrent=config.conversion.max_concurrent,
            drain_timeout_secs=config.conversion.drain_timeout_secs,
            canary_timeout_secs=config.conversion.canary_timeout_secs,
            cluster=self.cluster,
            record_span=self.tracing.record if self.tracing is not None else None,
        )
        if isinstance(self.cluster, EtcdCluster):
            self.cluster.settle_orphans_with(self.conversions.settle_orphan)
        self.autopilot = Autopilot(
            config,
            self.registry,
            self.latency,
            self.metrics,
            session=self.session,
            conversions=self.conversions,
            is_leader=self.cluster.is_leader,
        )
        self.load_poller = LoadPoller(self.registry, self.session, load_reporting_roles(config))
        self.discovery: Started | None = None
        self.parts = (
            Part("tracing", nothing, self._stop_tracing),
            Part("client sessions", nothing, self._close_sessions),
            Part("background tasks", nothing, self._cancel_background),
            Part("health monitor", self._open_health, self.health.stop),
            Part("cluster", self.cluster.start, self.cluster.stop),
            Part("first probes", self._probe_workers, nothing),
            Part("health probes", self._run_probes, nothing),
            Part("load reports", self._run_load_poller, self.load_poller.stop),
            Part("autopilot", self._run_autopilot, self.autopilot.stop),
            Part("discovery", self._start_discovery, self._stop_discovery),
            Part("conversions", nothing, self._close_conversions),
        )

    def _cluster(self) -> Cluster:
        """The replicas this router agrees with: etcd's with ``[cluster]``, else none."""
        if not self.config.cluster.enabled:
            return LocalCluster(self.registry)
        return EtcdCluster(
            self.config,
            self.registry,
            self.metrics,
            probe=self.health.check,
            spawn=self.spawn,
            session=self.session,
        )

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every part in order. A part that fails (WorkersUnreachable: some worker did
        not pass a probe within ``health.startup_wait_secs``; DiscoveryUnavailable) stops the
        router and is raised."""
        for part in self.parts:
            try:
                await part.start()
            except (WorkersUnreachable, DiscoveryUnavailable):
                await self.stop()
                raise

    async def stop(self) -> None:
        """Stop every part, in the reverse order of their start: the conversions first (with
        ``server.shutdown_grace_secs`` for those whose switch call went out), the sessions
        last."""
        for part in reversed(self.parts):
            await part.stop()

    async def _stop_tracing(self) -> None:
        """Export the spans not sent yet (the exporter's HTTP call blocks: off the loop)."""
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)

    async def _open_health(self) -> None:
        self.health.start(self.session)

    async def _probe_workers(self) -> None:
        """Probe every worker once; with ``health.startup_wait_secs``, until every worker
        passed a probe."""
        await self.health.probe_all()
        if self.config.health.startup_wait_secs > 0:
            await self.health.wait_for_workers(self.config.health.startup_wait_secs)

    async def _run_probes(self) -> None:
        self.health.run_in_background()

    async def _run_load_poller(self) -> None:
        if self.load_poller.roles:
            self.load_poller.run_in_background()

    async def _run_autopilot(self) -> None:
        self.autopilot.run_in_background()

    async def _start_discovery(self) -> None:
        """Workers from Kubernetes or a manifest file, when configured: they join and leave as
        through the admin API."""
        if self.config.discovery.active_provider is None:
            return
        control = WorkerControl(self.session, self.registry, headers=self.leg_setup.worker_headers)

        async def read_live_role(url: str) -> Role | None:
            try:
                return live_role(await control.server_info(url))
            except ControlError:
                return None

        self.discovery = await start_discovery(
            self.config.discovery, self.registry, self.cluster, self.metrics,
            probe=self.health.check, remove=self.remove_worker, live_role=read_live_role,
            let_go=self.conversions.let_go, on_converted=self.conversions.on_succeeded,
        )  # fmt: skip

    async def _stop_discovery(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()

    async def _close_conversions(self) -> None:
        await self.conversions.close(self.config.server.shutdown_grace_secs)

    async def _cancel_background(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)

    async def _close_sessions(self) -> None:
        await self._control_session.close()
        await self.session.close()

    # --- removals and background work -------------------------------------------------------

    async def remove_worker(self, worker: Worker) -> bool:
        """Wait for the in-flight requests of a REMOVING worker, then forget it; returns
        whether the wait timed out (``worker_removal_timeout_secs``: requests still running
        are then left to the registry's ``on_unavailable`` listeners)."""
        try:
            await asyncio.wait_for(
                worker.wait_until_no_inflight(), self.config.worker_removal_timeout_secs
            )
            forced = False
        except TimeoutError:
            forced = True
        if self.registry.registered(worker):
            self.registry.forget(worker)
        await self.cluster.end_removal(worker)
        return forced

    async def remove_detached(self, worker: Worker) -> bool:
        """:meth:`remove_worker` as a task of its own: a caller that goes away (a client
        closing its DELETE) does not cut the removal short."""
        return await asyncio.shield(self.spawn(self.remove_worker(worker)))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background (fire-and-forget aborts), kept until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


def load_reporting_roles(config: RouterConfig) -> frozenset[Role]:
    """The pools whose policy routes by what the workers report about their own load."""
    return frozenset(
        role for role in Role if canonical_policy_name(config.policy_of(role)) == "least_load"
    )


ROUTER = web.AppKey("router", Router)


def build_app(config: RouterConfig, metrics: RouterMetrics | None = None) -> web.Application:
    """The router application for ``config`` (workers registered, not yet probed), built in
    the running event loop; it starts and stops the router with the application."""
    router = Router(config, metrics)
    app = application(config, router.request_metrics)
    app[ROUTER] = router
    app[keys.CONFIG] = config
    app[keys.METRICS] = router.metrics
    app[keys.REGISTRY] = router.registry
    app[keys.HEALTH] = router.health
    app[keys.CLUSTER] = router.cluster
    app[keys.CONVERSIONS] = router.conversions
    app[keys.AUTOPILOT] = router.autopilot
    app[keys.DATAPLANES] = router.dataplanes
    app[keys.SESSION] = router.session
    app[keys.REMOVE_WORKER] = router.remove_detached
    app.on_startup.append(lambda _: router.start())
    app.on_cleanup.append(lambda _: router.stop())
    return app
