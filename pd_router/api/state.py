"""The router's state object: one per application, stored under :data:`ROUTER`.

It owns the configuration, the worker registry, the metrics, the admission of generation
requests by number and rate (:attr:`Router.admission`), the other router replicas it agrees
with (:attr:`Router.cluster`, alone without ``[cluster]``), the one shared aiohttp client
session (probes, fan-outs, aborts, worker control), the keep-alive pool of the request legs
(:attr:`Router.legs`), the selection policies, the health monitor, the recent latencies of
finished requests (:attr:`Router.latency`) and the autopilot that reads them; handlers reach
everything through it. :attr:`Router.conversions` is set by ``conversion_api`` when the
application starts (its conversion manager lives as long as its control session).

Worker lifecycle lives in the registry alone. The router listens to it: the legs still running
on a worker that stops taking requests (unhealthy, FAILED, removed) are ended at once.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pd_protocol.wire import ROLE_HEADER
from pd_router.config import RouterConfig
from pd_router.control.autopilot.controller import Autopilot
from pd_router.control.cluster.etcd import EtcdCluster
from pd_router.control.cluster.local import Cluster, LocalCluster
from pd_router.control.discovery.config import DiscoveryUnavailable
from pd_router.control.discovery.start import Started, start_discovery
from pd_router.control.health import HealthMonitor, WorkersUnreachable
from pd_router.control.latency import LatencyRecorder
from pd_router.control.worker_control import ControlError, WorkerControl, live_role
from pd_router.control.workers import Role, Unavailability, Worker, WorkerRegistry, WorkerState
from pd_router.dataplane.concurrency import RequestAdmission
from pd_router.dataplane.http1 import Http1Pool
from pd_router.dataplane.http1_conn import WorkerUnavailable
from pd_router.dataplane.policies import Policy, make_policy
from pd_router.dataplane.upstream import Legs
from pd_router.errors import NoWorkers
from pd_router.metrics import RouterMetrics
from pd_router.tls import worker_context

if TYPE_CHECKING:
    from pd_router.control.conversion.manager import ConversionManager

log = logging.getLogger("pd_router")


class Router:
    """Everything a request handler needs, created by ``server.build_app``."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or RouterMetrics()
        self.registry = WorkerRegistry(self.metrics, config.circuit)
        self.policies: dict[Role, Policy] = {
            Role.PREFILL: make_policy(config.prefill_policy, config.cache_aware),
            Role.DECODE: make_policy(config.decode_policy, config.cache_aware),
        }
        self.health = HealthMonitor(self.registry, config.health)
        self.admission = RequestAdmission(config.admission, self.metrics)
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
        # Sent on every call to a worker (legs, probes, fan-outs, aborts, control).
        self.worker_headers: dict[str, str] = (
            {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
        )
        self._session: aiohttp.ClientSession | None = None
        self.discovery: Started | None = None
        # Every connection to an https:// worker (legs, session, control) verifies it with
        # this context; None: the defaults (system CAs, no client certificate).
        self.worker_ssl: ssl.SSLContext | None = (
            worker_context(config.tls) if config.tls.configures_workers else None
        )
        self.legs = Http1Pool(
            connect_timeout=config.connect_timeout_secs,
            request_timeout=config.request_timeout_secs,
            ssl_context=self.worker_ssl,
        )
        # What every leg uses (the pool, its limits, the error metric), and the headers of each
        # role's legs but the request id. A leg names the role it is routed as: an extension
        # worker that serves the other role answers 421 at once instead of failing the KV
        # hand-off minutes later.
        self.upstream = Legs(self.legs, config.legs, self.count_upstream_error)
        self.leg_headers: dict[Role, dict[str, str]] = {
            role: {
                "Content-Type": "application/json",
                **self.worker_headers,
                ROLE_HEADER: role.value,
            }
            for role in Role
        }
        self.registry.on_unavailable(self._end_legs)
        self.registry.on_left_pool(lambda worker, role: self.policies[role].forget(worker.url))
        self._background: set[asyncio.Task] = set()
        self._request_children: dict[tuple[str, int], Any] = {}
        self._duration_children: dict[str, Any] = {}
        self._upstream_error_children: dict[tuple[str, str], Any] = {}
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
        self.legs.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _end_legs(self, worker: Worker, why: Unavailability) -> None:
        """A worker left service (unhealthy, FAILED, removed): end the legs still running on
        it now, so their clients get a retry or an error instead of waiting for a frozen or
        departed worker until a timeout."""
        self.legs.abort_target(
            worker.url, WorkerUnavailable(f"worker {worker.url} left service: {why.value}")
        )

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``coro`` in the background (fire-and-forget aborts), kept until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # --- selection --------------------------------------------------------------------------

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
        workers = self.registry.selectable(role) or self.circuit_panic_pool(role, avoid)
        if avoid and len(workers) > 1:
            avoided = set(avoid)
            fresh = [w for w in workers if w not in avoided]
            if fresh:
                workers = fresh
        if not workers:
            self.latency.count_refusal(role.value)
            raise NoWorkers(f"no available {role.value} worker (none active, healthy and closed)")
        policy = self.policies[role]
        if policy.needs_prompt and prompt is not None:
            return policy.select(workers, prompt())
        return policy.select(workers)

    def circuit_panic_pool(self, role: Role, avoid: Iterable[Worker] = ()) -> list[Worker]:
        """The ACTIVE, healthy workers of ``role`` not in ``avoid``, for when none is
        selectable: each is then kept out only by its circuit (open, or its half-open trial
        taken). A circuit steers traffic to other workers, and there are none; answering 503
        would make a whole burst fail after an outage the probes saw end (see
        :mod:`pd_router.control.circuit`). A worker that already failed this request is not tried
        again through its open circuit."""
        avoided = set(avoid)
        return [
            w
            for w in self.registry.in_role(role, (WorkerState.ACTIVE,))
            if w.healthy and w.admitting and w not in avoided
        ]

    # --- metrics (children cached: no per-request label lookups) -----------------------------

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        counter = self._request_children.get(key)
        if counter is None:
            counter = self.metrics.requests_total.labels(endpoint, str(status))
            self._request_children[key] = counter
        counter.inc()
        histogram = self._duration_children.get(endpoint)
        if histogram is None:
            histogram = self.metrics.request_duration_seconds.labels(endpoint)
            self._duration_children[endpoint] = histogram
        histogram.observe(seconds)

    def count_upstream_error(self, role: Role, kind: str) -> None:
        key = (role.value, kind)
        counter = self._upstream_error_children.get(key)
        if counter is None:
            counter = self.metrics.upstream_errors_total.labels(role.value, kind)
            self._upstream_error_children[key] = counter
        counter.inc()


ROUTER = web.AppKey("router", Router)
REQUEST_ID = web.RequestKey("request_id", str)
# The id workers know a request by (its ``rid``): the request id itself when the router made it,
# the client's id plus a unique suffix otherwise, so two requests that carry the same
# X-Request-Id never collide on a worker (SGLang rejects a duplicate rid).
UPSTREAM_ID = web.RequestKey("upstream_id", str)
# The status of a streamed answer whose end reached the client (its ``data: [DONE]`` event or
# its last byte): a client that closes the connection after it is not an abort, whatever the
# handler was still doing (reading the worker's end of stream, releasing the legs).
DELIVERED = web.RequestKey("delivered", int)


def router_of(request: web.Request) -> Router:
    return request.app[ROUTER]
