"""The router's servers: the aiohttp application (routes, the middleware: request id, admin
auth, body size, error mapping, request metrics; CORS in front when configured; the lifecycle of
the shared state) and the client side in front of it.

``build_app(config)`` returns an Application holding one :class:`~pd_router.api.state.Router` under
:data:`ROUTER`; other modules add their routes to that app (``add_conversion_routes(app)``,
``add_dashboard_routes(app)``). Run it with :func:`start_server` (tests, demo) or :func:`run_server`
(the CLI). Clients connect to a data plane's front (:mod:`pd_router.dataplane.front`: header
and body timeouts, the client connection cap, HTTPS with ``[tls]`` cert and key), which serves
the generation endpoints itself and relays every other request to the application, listening
on a Unix socket of its own with handler cancellation, so a client that goes away cancels its
request. With ``--workers 1`` the data plane runs in this process, fed by the same snapshots as
the data-plane processes of ``--workers N`` (:mod:`pd_router.api.dataplane_process`) over a
channel with no socket.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from pd_protocol.listen import ListenError
from pd_router.api import engine_metrics, info, loads
from pd_router.api import workers as workers_api
from pd_router.api.app_socket import SHUTDOWN_GRACE_SECS, AppSocket
from pd_router.api.auth import is_admin_path, require_admin
from pd_router.api.autopilot import add_autopilot_routes
from pd_router.api.conversions import add_conversion_routes
from pd_router.api.cors import add_cors
from pd_router.api.dashboard import add_dashboard_routes
from pd_router.api.dataplane_process import DataPlane, client_limits
from pd_router.api.processes import serve_processes
from pd_router.api.signals import begin_stop, stop_signalled
from pd_router.api.state import ROUTER, Router
from pd_router.config import RouterConfig
from pd_router.control.discovery.config import DiscoveryUnavailable
from pd_router.control.health import WorkersUnreachable
from pd_router.dataplane.admission import BodyAdmission
from pd_router.dataplane.channel import LocalChannel
from pd_router.dataplane.front.ids import RequestIds
from pd_router.dataplane.front.relay import Relay
from pd_router.dataplane.listener import default_max_connections, fd_limit, raise_fd_limit
from pd_router.dataplane.path import RequestMetrics
from pd_router.dataplane.upstream import abort
from pd_router.errors import MAPPED_ERRORS, ClientClosedRequest, RouterError, error_response
from pd_router.metrics import RouterMetrics
from pd_router.tls import server_context

log = logging.getLogger("pd_router.api.server")

MAX_REQUEST_ID_LENGTH = 128

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

__all__ = ["ROUTER", "Router", "RunningServer", "build_app", "run_server", "start_server"]


REQUEST_IDS = web.AppKey("request_ids", RequestIds)
REQUEST_METRICS = web.AppKey("request_metrics", RequestMetrics)
BODY_ADMISSION = web.AppKey("body_admission", BodyAdmission)


def release_body(request: web.BaseRequest) -> None:
    """Drop the body aiohttp cached on ``request`` once it is answered. A keep-alive connection
    keeps its last request until the next one arrives, and with it the whole body: a client
    that sent a large prompt and then went idle pinned it."""
    request._read_bytes = None


def endpoint_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def core_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id in and out, admin auth, body admission (size limit and in-flight budget,
    before any of the body is read), one mapping from errors to JSON responses, and the
    request metrics for every endpoint. A handler cancelled because its client went away
    counts as 499."""
    app = request.app
    metrics = app[REQUEST_METRICS]
    loop = asyncio.get_running_loop()
    started = loop.time()
    request_id, _ = app[REQUEST_IDS].of(request.headers)
    admission = app[BODY_ADMISSION]
    admitted = 0
    try:
        if is_admin_path(request.path):
            require_admin(request)
        length = request.content_length
        if length:
            admission.admit(length)
            admitted = length
        response = await handler(request)
    except asyncio.CancelledError:
        metrics.observe_request(
            endpoint_label(request), ClientClosedRequest.status, loop.time() - started
        )
        raise
    except MAPPED_ERRORS as exc:
        response = error_response(exc)
    except Exception:
        log.exception("unhandled error", extra={"request_id": request_id, "path": request.path})
        response = error_response(RouterError("internal router error"))
    finally:
        release_body(request)
        if admitted:
            admission.release(admitted)
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    metrics.observe_request(endpoint_label(request), response.status, loop.time() - started)
    return response


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/health", info.handle_health)
    r.add_get("/liveness", info.handle_health)
    r.add_get("/readiness", info.handle_readiness)
    r.add_get("/health_generate", info.handle_health_generate)
    r.add_get("/metrics", info.handle_metrics)
    r.add_get("/cluster", info.handle_cluster)
    r.add_get("/engine_metrics", engine_metrics.handle_engine_metrics)
    r.add_get("/v1/models", info.handle_models)
    r.add_get("/v1/models/{model_id:.+}", info.handle_model)
    r.add_get("/get_loads", loads.handle_get_loads)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, info.handle_model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, info.handle_server_info)
    r.add_route("GET", "/flush_cache", info.handle_flush_cache)
    r.add_post("/flush_cache", info.handle_flush_cache)
    r.add_post("/abort_request", info.handle_abort_request)
    r.add_get("/workers", workers_api.handle_list_workers)
    r.add_post("/workers", workers_api.handle_add_worker)
    r.add_delete("/workers", workers_api.handle_remove_worker)
    r.add_get("/workers/{key:.+}", workers_api.handle_get_worker)
    r.add_delete("/workers/{key:.+}", workers_api.handle_remove_worker)


async def _on_startup(app: web.Application) -> None:
    await app[ROUTER].start()


async def _on_cleanup(app: web.Application) -> None:
    await app[ROUTER].stop()


def build_app(config: RouterConfig, metrics: RouterMetrics | None = None) -> web.Application:
    """The router application for ``config`` (workers registered, not yet probed)."""
    router = Router(config, metrics)
    app = web.Application(middlewares=[core_middleware], client_max_size=config.max_payload_size)
    app[ROUTER] = router
    app[REQUEST_METRICS] = router.request_metrics
    app[REQUEST_IDS] = RequestIds(config.request_id_headers)
    app[BODY_ADMISSION] = BodyAdmission(config.max_payload_size, config.max_inflight_body_bytes)
    add_cors(app, config.cors_allowed_origins)
    add_routes(app)
    add_dashboard_routes(app)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    add_conversion_routes(app)
    add_autopilot_routes(app)
    return app


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


def run_server(config: RouterConfig) -> None:
    """Serve until interrupted (the CLI's ``serve``), on uvloop when available, with the open
    file limit raised as far as allowed. Exits 1 when workers do not come up within
    ``health.startup_wait_secs``."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    nofile = raise_fd_limit()
    safe = default_max_connections(nofile)
    if config.max_client_connections > safe:
        log.warning(
            "max_client_connections %d leaves too few of the %d open files for worker "
            "connections (%d would)", config.max_client_connections, nofile, safe,
        )  # fmt: skip
    app = build_app(config)
    tune_gc()
    processes = config.server.processes
    serving = (
        serve_processes(config, app, processes, client_limits(config).max_connections)
        if processes > 1
        else serve_until_signalled(app, config)
    )
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop is not None else None) as r:
        try:
            r.run(serving)
        except WorkersUnreachable as exc:
            log.error("%s; not serving", exc, extra={"workers": exc.urls})
            raise SystemExit(1) from None
        except DiscoveryUnavailable as exc:
            log.error("%s; not serving", exc)
            raise SystemExit(1) from None
