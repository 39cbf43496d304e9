"""Serving the router in this process: :func:`start_server` (tests, the demo) runs the
application and one data plane in the running loop; :func:`run_server` (the CLI's ``serve``)
runs until SIGINT or SIGTERM, with ``--workers N`` as a control process and N data-plane
processes (:mod:`pd_router.runtime.processes`).

Clients connect to a data plane's front (:mod:`pd_router.dataplane.front`: header and body
timeouts, the client connection cap, HTTPS with ``[tls]`` cert and key), which serves the
generation endpoints itself and relays every other request to the application, listening on a
Unix socket of its own with handler cancellation, so a client that goes away cancels its
request. With ``--workers 1`` the data plane runs in this process, fed by the same snapshots as
the data-plane processes of ``--workers N`` (:mod:`pd_router.runtime.dataplane_process`) over a
channel with no socket.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from pd_protocol.listen import ListenError
from pd_router.api.server import BODY_ADMISSION
from pd_router.config import RouterConfig
from pd_router.control.discovery.config import DiscoveryUnavailable
from pd_router.control.health import WorkersUnreachable
from pd_router.dataplane.front.listener import default_max_connections, fd_limit, raise_fd_limit
from pd_router.dataplane.front.relay import Relay
from pd_router.dataplane.legs.leg import abort
from pd_router.dataplane.link.channel import LocalChannel
from pd_router.runtime.app_socket import AppSocket
from pd_router.runtime.dataplane_process import DataPlane, client_limits
from pd_router.runtime.processes import serve_processes
from pd_router.runtime.router import ROUTER, Router, build_app
from pd_router.runtime.signals import begin_stop
from pd_router.shutdown import SHUTDOWN_GRACE_SECS, stop_signalled
from pd_router.tls import server_context

log = logging.getLogger("pd_router.runtime")


@dataclass
class RunningServer:
    """A router serving on a port; ``url`` is where to reach it."""

    app: web.Application
    app_socket: AppSocket
    relay: Relay
    dataplane: DataPlane
    host: str
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @property
    def router(self) -> Router:
        return self.app[ROUTER]

    async def stop(self, grace_secs: float = SHUTDOWN_GRACE_SECS) -> None:
        """Stop accepting, let requests in flight finish (up to ``grace_secs``), stop the
        router."""
        await self.dataplane.stop(grace_secs)
        await self.router.dataplanes.stop()
        await self.relay.stop()
        await self.app_socket.stop()


async def start_server(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    sock: socket.socket | None = None,
) -> RunningServer:
    """Serve the router application ``app`` in the running loop (port 0: a free port; ``sock``:
    on that listening socket instead), its data plane in this process; stop with ``.stop()``.
    Client limits and TLS come from its config. ListenError when the address cannot be
    bound."""
    router = app[ROUTER]
    ssl_context = server_context(router.config.tls)
    app_socket = await AppSocket.start(app)
    relay = Relay(app_socket.path)
    await relay.start()
    control_end, plane_end = LocalChannel.pair()
    router.dataplanes.attach(0, control_end)
    dataplane = DataPlane(
        router.config,
        0,
        plane_end,
        metrics=router.metrics,
        request_metrics=router.request_metrics,
        setup=router.leg_setup,
        relay=relay,
        body_admission=app[BODY_ADMISSION],
        ssl_context=ssl_context,
        abort=lambda worker, rids: router.spawn(abort(router.session, worker, rids)),
        # Its requests count into the router's own metrics: nothing to add to them.
        samples=list,
        tracer=router.tracing,
    )
    try:
        host, port = await dataplane.start(host, port, sock=sock)
    except OSError as exc:
        await router.dataplanes.stop()
        await relay.stop()
        await app_socket.stop()
        raise ListenError(host, port, "--port", exc) from exc
    scheme = "https" if ssl_context is not None else "http"
    return RunningServer(app, app_socket, relay, dataplane, host, port, scheme)


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory, or None (asyncio's default loop) where it is not
    installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def tune_gc() -> None:
    """Every request leaves short-lived cycles (tasks, futures, responses); with the default
    thresholds the collector ran often enough to take a fifth of the router's CPU. Freeze what
    start-up allocated and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 50, 100)


async def serve_until_signalled(app: web.Application, config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM, then stop gracefully (in-flight requests may finish)."""
    server = await start_server(app, config.host, config.port)
    limits = client_limits(config)
    log.info(
        "serving on %s (client connections up to %d, open file limit %d)",
        server.url, limits.max_connections, fd_limit(),
    )  # fmt: skip
    try:
        begin_stop(app, await stop_signalled())
    finally:
        await server.stop(config.server.shutdown_grace_secs)


async def serve(config: RouterConfig) -> None:
    """Build the router in this loop and serve it: here with its data plane, or as the control
    process of ``server.processes`` data planes."""
    app = build_app(config)
    tune_gc()
    processes = config.server.processes
    if processes > 1:
        await serve_processes(config, app, processes, client_limits(config).max_connections)
    else:
        await serve_until_signalled(app, config)


def run_server(config: RouterConfig) -> None:
    """Serve until interrupted (the CLI's ``serve``), on uvloop when available, with the open
    file limit raised as far as allowed. Exits 1 when workers do not come up within
    ``health.startup_wait_secs``."""
    nofile = raise_fd_limit()
    safe = default_max_connections(nofile)
    if config.max_client_connections > safe:
        log.warning(
            "max_client_connections %d leaves too few of the %d open files for worker "
            "connections (%d would)", config.max_client_connections, nofile, safe,
        )  # fmt: skip
    with asyncio.Runner(loop_factory=uvloop_factory()) as r:
        try:
            r.run(serve(config))
        except WorkersUnreachable as exc:
            log.error("%s; not serving", exc, extra={"workers": exc.urls})
            raise SystemExit(1) from None
        except DiscoveryUnavailable as exc:
            log.error("%s; not serving", exc)
            raise SystemExit(1) from None
