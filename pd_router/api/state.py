"""The router's state object: one per application, stored under :data:`ROUTER`.

It is the control side: the configuration, the worker registry, the metrics, the other router
replicas it agrees with (:attr:`Router.cluster`, alone without ``[cluster]``), the one shared
aiohttp client session (probes, fan-outs, aborts, worker control), the health monitor, the
recent latencies of finished requests (:attr:`Router.latency`) and the autopilot that reads
them, and the links to the data planes that serve the requests (:attr:`Router.dataplanes`:
the snapshots of the registry they route from, the reports they send back); handlers reach
everything through it. :attr:`Router.conversions` is set by ``conversion_api`` when the
application starts (its conversion manager lives as long as its control session).

Worker lifecycle lives in the registry alone; a data plane learns of every change from the
next snapshot (a worker that stops taking requests gets its legs ended there).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pd_router.config import RouterConfig
from pd_router.control.autopilot.controller import Autopilot
from pd_router.control.cluster.etcd import EtcdCluster
from pd_router.control.cluster.local import Cluster, LocalCluster
from pd_router.control.dataplanes import DataPlanes
from pd_router.control.discovery.config import DiscoveryUnavailable
from pd_router.control.discovery.start import Started, start_discovery
from pd_router.control.health import HealthMonitor, WorkersUnreachable
from pd_router.control.latency import LatencyRecorder
from pd_router.control.worker_control import ControlError, WorkerControl, live_role
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.dataplane.legs import leg_setup
from pd_router.dataplane.path import RequestMetrics
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role

if TYPE_CHECKING:
    from pd_router.control.conversion.manager import ConversionManager

log = logging.getLogger("pd_router")


class Router:
    """Everything a request handler needs, created by ``server.build_app``."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.registry = WorkerRegistry(self.metrics, config.circuit)
        self.health = HealthMonitor(self.registry, config.health)
        self.conversions: ConversionManager | None = None
        self.latency = LatencyRecorder()
        self.autopilot = Autopilot(
            config,
            self.registry,
            self.latency,
            self.metrics,
            session=lambda: self.session,
            conversions=lambda: self.conversions,
            is_leader=lambda: self.cluster.is_leader(),
        )
        self.cluster: Cluster = (
            EtcdCluster(
                config,
                self.registry,
                self.metrics,
                probe=self.health.check,
                spawn=self.spawn,
                session=lambda: self.session,
                conversions=lambda: self.conversions,
            )
            if config.cluster.enabled
            else LocalCluster(self.registry)
        )
        # The request metrics' cached children and the legs' setup: the data plane of a
        # one-process router counts and sends with these (the control side calls workers with
        # the same headers and TLS).
        self.request_metrics = RequestMetrics(self.metrics)
        self.leg_setup = leg_setup(config, self.request_metrics.count_upstream_error)
        self.worker_headers = self.leg_setup.worker_headers
        self.worker_ssl = self.leg_setup.worker_ssl
        self.dataplanes = DataPlanes(self.registry, self.health, self.latency)
        self._session: aiohttp.ClientSession | None = None
        self.discovery: Started | None = None
        self._background: set[asyncio.Task] = set()
        for spec in config.prefill:
            self.registry.add(spec.url, Role.PREFILL, spec.bootstrap_port, healthy=False)
        for spec in config.decode:
            self.registry.add(spec.url, Role.DECODE, healthy=False)

    # --- lifecycle --------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        """The one shared client session (exists between start() and stop())."""
        if self._session is None:
            raise RuntimeError("router not started")
        return self._session

    async def start(self) -> None:
        """Open the session, probe every worker once (with ``health.startup_wait_secs``, until
        every worker passed a probe: WorkersUnreachable if some do not in time), start the
        health monitor. The session keeps no cookies: one client's worker cookies must not
        reach another client."""
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections,
            limit_per_host=0,
            keepalive_timeout=75,
            ttl_dns_cache=300,
            ssl=self.worker_ssl if self.worker_ssl is not None else True,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(
                total=self.config.request_timeout_secs,
                sock_connect=self.config.connect_timeout_secs,
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            headers=self.worker_headers,
        )
        self.health.start(self._session)
        await self.cluster.start()
        await self.health.probe_all()
        if self.config.health.startup_wait_secs > 0:
            try:
                await self.health.wait_for_workers(self.config.health.startup_wait_secs)
            except WorkersUnreachable:
                await self.stop()
                raise
        self.health.run_in_background()
        self.autopilot.run_in_background()
        await self._start_discovery()

    async def _start_discovery(self) -> None:
        """Workers from Kubernetes or a manifest file, when configured: they join and leave as
        through the admin API."""
        if self.config.discovery.active_provider is None:
            return
        control = WorkerControl(self.session, self.registry, headers=self.worker_headers)

        async def read_live_role(url: str) -> Role | None:
            try:
                return live_role(await control.server_info(url))
            except ControlError:
                return None

        async def let_go(worker: Worker) -> bool:
            return self.conversions is not None and await self.conversions.let_go(worker)

        def on_converted(callback: Callable[[Worker, Role], None]) -> None:
            if self.conversions is not None:
                self.conversions.on_succeeded(callback)

        try:
            self.discovery = await start_discovery(
                self.config.discovery, self.registry, self.cluster, self.metrics,
                probe=self.health.check, remove=self.remove_worker, live_role=read_live_role,
                let_go=let_go, on_converted=on_converted,
            )  # fmt: skip
        except DiscoveryUnavailable:
            await self.stop()
            raise

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

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.autopilot.stop()
        await self.cluster.stop()
        await self.health.stop()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background (fire-and-forget aborts), kept until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


ROUTER = web.AppKey("router", Router)


def router_of(request: web.Request) -> Router:
    return request.app[ROUTER]
