"""The data plane: the pools the control side's snapshots make, the request path over them,
the client side, and the reports back (:class:`DataPlane`). Every router serves its clients
through data planes: a one-process router (``--workers 1``) runs one beside its control side,
fed over a :class:`~pd_router.dataplane.link.channel.LocalChannel`
(:func:`pd_router.runtime.serve.start_server`); a router of ``--workers N`` runs one in each
data-plane process (:func:`serve_dataplane`), started by the control process
(:mod:`pd_router.runtime.processes`) with its listening socket and its channel.

A data plane serves the generation endpoints from its pools (it takes the first snapshot
before it accepts a connection) and reports back (:mod:`pd_router.dataplane.link.reports`); every
other path is relayed to the router's application (:mod:`pd_router.dataplane.front.relay`).

A data plane opens its channel with a hello naming its protocol version and reads the control
side's (:mod:`pd_router.wire`); a data-plane process that finds another version exits with
status 2 and one line saying both. It stops on SIGTERM or SIGINT (exit status 0) and when the
control process goes away (exit status 1): it stops accepting and lets the requests in flight
finish, up to the shutdown deadline. Without the control process nothing probes the workers,
decides their circuits or honours a conversion any more, so routing on from the last snapshot
could send traffic to a worker another router is switching; the orchestrator restarts the whole
router instead. A control process that hangs (stopped, or its event loop blocked) goes away
too: one that sent nothing for :data:`CONTROL_SILENCE_SECS` (it sends every second) is killed,
since it holds every listening socket and would keep taking connections that nobody answers
once its data planes left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp

from pd_router.config import RouterConfig
from pd_router.dataplane.front.admission import BodyAdmission
from pd_router.dataplane.front.concurrency import RequestAdmission
from pd_router.dataplane.front.cors import CorsPolicy
from pd_router.dataplane.front.dispatch import Dispatcher, FrontPolicy
from pd_router.dataplane.front.ids import RequestIds
from pd_router.dataplane.front.listener import (
    ClientConnections,
    ClientLimits,
    default_max_connections,
    fd_limit,
)
from pd_router.dataplane.front.relay import Relay
from pd_router.dataplane.front.server import FrontServer
from pd_router.dataplane.legs.connection import WorkerUnavailable
from pd_router.dataplane.legs.leg import abort
from pd_router.dataplane.legs.setup import LegSetup, leg_setup
from pd_router.dataplane.link.channel import Channel
from pd_router.dataplane.link.reports import Reports
from pd_router.dataplane.path.collaborators import PathCollaborators, RequestMetrics
from pd_router.dataplane.routing.policies import make_policy
from pd_router.dataplane.routing.snapshot import SnapshotPools
from pd_router.dataplane.routing.target import Target
from pd_router.metrics import RouterMetrics, samples
from pd_router.roles import Role
from pd_router.runtime.tracing import start_tracing
from pd_router.shutdown import SHUTDOWN_GRACE_SECS, stop_signalled
from pd_router.tls import server_context
from pd_router.wire import (
    PROTOCOL_VERSION,
    ChannelClosed,
    ChannelEnd,
    Hello,
    InconsistentSnapshot,
    InflightTotals,
    Message,
    MetricsAsk,
    Snapshot,
    VersionMismatch,
    WireError,
    WorkerLoads,
    check_hello,
)

if TYPE_CHECKING:
    from pd_router.otel_tracing import Tracing

log = logging.getLogger("pd_router.dataplane")

FIRST_SNAPSHOT_TIMEOUT_SECS = 30.0
CONTROL_SILENCE_SECS = 10.0


def client_limits(config: RouterConfig) -> ClientLimits:
    """The client side's timeouts and connection cap (the cap sized from the open file limit
    unless configured)."""
    return ClientLimits(
        header_timeout=config.client_header_timeout_secs,
        body_timeout=config.client_body_timeout_secs,
        keepalive_timeout=config.client_keepalive_timeout_secs,
        max_connections=config.max_client_connections or default_max_connections(fd_limit()),
    )


def front_server(
    config: RouterConfig,
    path: PathCollaborators,
    relay: Relay,
    admission: BodyAdmission,
    ssl_context: ssl.SSLContext | None,
    connections: ClientConnections,
) -> FrontServer:
    """The client side of one data plane: the generation endpoints served from ``path``, every
    other request relayed by ``relay``; bodies admitted by ``admission``; its open connections
    counted in ``connections``, which it reports."""
    cors = CorsPolicy(config.cors_allowed_origins) if config.cors_allowed_origins else None
    policy = FrontPolicy(RequestIds(config.request_id_headers), admission, cors)
    dispatcher = Dispatcher(path, relay, policy)
    return FrontServer(dispatcher, client_limits(config), ssl_context, connections)


class DataPlane:
    """Data plane ``index``: pools, request path, client side and reports, talking to the
    control side over ``channel``. Its requests count into ``metrics`` (and ``request_metrics``,
    their cached children); ``samples()`` gives what its reports send of them (nothing when
    they are the control side's own). Its legs go through ``setup``; clients connect with TLS
    when ``ssl_context`` is given; ``abort(worker, rids)`` asks a worker to drop requests, in
    the background. ``on_control_silent`` is called when the control side sent nothing for
    :data:`CONTROL_SILENCE_SECS` (None: not watched, as for a data plane in the control side's
    own event loop, where a silence could only be that loop stalled). ``tracer``: where its
    requests' spans go (None: tracing off)."""

    def __init__(
        self,
        config: RouterConfig,
        index: int,
        channel: ChannelEnd,
        *,
        metrics: RouterMetrics,
        request_metrics: RequestMetrics,
        setup: LegSetup,
        relay: Relay,
        body_admission: BodyAdmission,
        ssl_context: ssl.SSLContext | None,
        abort: Callable[[Target, list[str]], object],
        samples: Callable[[], list[list]],
        on_control_silent: Callable[[], None] | None = None,
        tracer: Tracing | None = None,
    ) -> None:
        self.channel = channel
        self.connections = ClientConnections(
            client_limits(config).max_connections, metrics.client_connections_moved_total.inc
        )
        self.reports = Reports(channel, samples, self.connections)
        self.legs = setup.pool
        shared = config.server.processes > 1
        self.pools = SnapshotPools(
            {
                role: make_policy(config.policy_of(role), config.cache_aware, shared=shared)
                for role in Role
            },
            index=index,
            wake=self.reports.wake,
            suspect=self.reports.suspect,
            stuck=self.reports.stuck,
            count_refusal=self.reports.count_refusal,
            on_unavailable=self._end_legs,
        )
        self.path = PathCollaborators(
            pools=self.pools,
            legs=setup.legs,
            leg_headers=setup.leg_headers,
            retry=config.retry,
            admission=RequestAdmission(
                config.admission.shared_by(config.server.processes), metrics
            ),
            latency=self.reports,
            metrics=request_metrics,
            abort=abort,
            tracer=tracer,
        )
        self.front = front_server(
            config, self.path, relay, body_admission, ssl_context, self.connections
        )
        self._on_control_silent = on_control_silent
        # Set once the control side is gone (its channel closed, or it fell silent).
        self.control_gone = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, sock: socket.socket | None = None
    ) -> tuple[str, int]:
        """Exchange hellos with the control side and take its first snapshot, then listen on
        ``host``:``port`` (or ``sock``) and follow the control side; returns the address bound.
        VersionMismatch when the control side speaks another protocol version; ChannelClosed,
        WireError or TimeoutError without a snapshot; OSError when the address cannot be
        bound."""
        self.channel.send(Hello(PROTOCOL_VERSION))
        async with asyncio.timeout(FIRST_SNAPSHOT_TIMEOUT_SECS):
            check_hello(await self.channel.receive())
            first = await self.channel.receive()
        if not isinstance(first, Snapshot):
            raise WireError(f"{type(first).__name__} before the first snapshot")
        self.take(first)
        address = await self.front.start(host, port, sock=sock)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._follow()),
            loop.create_task(self.reports.run(self.pools)),
        ]
        return address

    def take(self, message: Message) -> None:
        """Apply one message of the control side; WireError for one that is not for a data
        plane."""
        match message:
            case Snapshot():
                self._take_snapshot(message)
            case InflightTotals():
                self.pools.apply_inflight(message.totals)
                self.connections.share = message.share
            case WorkerLoads():
                self.pools.apply_loads(message)
            case MetricsAsk():
                self.reports.send_metrics(message.request)
            case _:
                raise WireError(f"a {type(message).__name__}, which is not for a data plane")

    def _take_snapshot(self, snapshot: Snapshot) -> None:
        """Route from ``snapshot`` and ack it at once; an inconsistent one is not applied,
        and the control side is told so."""
        try:
            self.pools.apply(snapshot)
        except InconsistentSnapshot as exc:
            routing = self.pools.version
            log.error(
                "data plane %d: snapshot %d not applied (%s); routing on from snapshot %d",
                self.pools.index, snapshot.version, exc, routing,
            )  # fmt: skip
            self.reports.refused(snapshot.version, routing, str(exc))
            return
        self.reports.send(self.pools, force=True)

    async def _follow(self) -> None:
        """Apply what the control side sends until its channel closes, or until it has been
        silent for :data:`CONTROL_SILENCE_SECS` where that is looked at."""
        silence = None if self._on_control_silent is None else CONTROL_SILENCE_SECS
        try:
            while True:
                self.take(await asyncio.wait_for(self.channel.receive(), silence))
        except ChannelClosed:
            pass
        except WireError as exc:
            log.error("data plane %d: the control side sent %s", self.pools.index, exc)
        except TimeoutError:
            if self._on_control_silent is not None:
                self._on_control_silent()
        self.control_gone.set()

    async def stop(self, grace_secs: float = SHUTDOWN_GRACE_SECS) -> None:
        """Stop accepting, let the requests in flight finish (up to ``grace_secs``), send the
        last report and close the channel and the legs' pool."""
        await self.front.stop(grace_secs)
        for task in self._tasks:
            task.cancel()
        self.reports.send(self.pools)
        self.channel.close()
        self.legs.close()

    def _end_legs(self, url: str) -> None:
        """A worker left service (unhealthy, FAILED, removed): end the legs still running on
        it now, so their clients get a retry or an error instead of waiting for a frozen or
        departed worker until a timeout."""
        self.legs.abort_target(url, WorkerUnavailable(f"worker {url} left service"))


class Background:
    """Fire-and-forget tasks (aborts), kept until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def serve_dataplane(
    config: RouterConfig,
    index: int,
    listen: socket.socket,
    channel_socket: socket.socket,
    control_socket: str,
) -> int:
    """Serve as data-plane process ``index`` until told to stop (0) or until the control
    process is gone (1)."""
    control = os.getppid()
    metrics = RouterMetrics()
    request_metrics = RequestMetrics(metrics)
    setup = leg_setup(config, request_metrics.count_upstream_error)
    # For aborts only: the legs have their own pool.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=setup.worker_ssl or True),
        headers=setup.worker_headers,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )
    background = Background()
    relay = Relay(control_socket)
    await relay.start()
    plane = DataPlane(
        config,
        index,
        await Channel.over(channel_socket),
        metrics=metrics,
        request_metrics=request_metrics,
        setup=setup,
        relay=relay,
        body_admission=BodyAdmission(config.max_payload_size, config.max_inflight_body_bytes),
        ssl_context=server_context(config.tls),
        abort=lambda worker, rids: background.spawn(abort(session, worker, rids)),
        samples=lambda: samples(metrics),
        on_control_silent=lambda: kill_hung_control(control),
        # Each data-plane process exports its own spans.
        tracer=start_tracing(config.tracing, f"dataplane-{index}"),
    )
    unstarted = await start(plane, listen, index)
    if unstarted is not None:
        await relay.stop()
        await session.close()
        return unstarted
    loop = asyncio.get_running_loop()
    gone = loop.create_task(plane.control_gone.wait())
    stopped = loop.create_task(stop_signalled())
    await asyncio.wait((gone, stopped), return_when=asyncio.FIRST_COMPLETED)
    control_gone = plane.control_gone.is_set()
    if control_gone:
        log.error("data plane %d: the control process is gone; stopping", index)
    for task in (gone, stopped):
        task.cancel()
    await plane.stop(config.server.shutdown_grace_secs)
    await relay.stop()
    await session.close()
    return 1 if control_gone else 0


async def start(plane: DataPlane, listen: socket.socket, index: int) -> int | None:
    """Start data plane ``index`` on ``listen``; when it cannot start, say why in one line and
    give the exit status (2: the control process speaks another protocol version)."""
    try:
        await plane.start(sock=listen)
    except VersionMismatch as exc:
        log.error(
            "data plane %d speaks protocol version %d, the control process %d; exiting",
            index, PROTOCOL_VERSION, exc.theirs,
        )  # fmt: skip
        return 2
    except (ChannelClosed, WireError, TimeoutError):
        log.error("data plane %d: no snapshot from the control process; exiting", index)
        return 1
    return None


def kill_hung_control(pid: int) -> None:
    """Kill the control process ``pid``, unless this process has outlived it already."""
    if os.getppid() != pid:
        return
    log.error(
        "the control process (pid %d) sent nothing for %.0f s; killing it", pid,
        CONTROL_SILENCE_SECS,
    )  # fmt: skip
    os.kill(pid, signal.SIGKILL)
