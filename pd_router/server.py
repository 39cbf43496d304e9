"""The aiohttp application: routes, the middleware (request id, admin auth, error mapping,
request metrics) and the lifecycle of the shared state.

``build_app(config)`` returns an Application holding one :class:`~pd_router.state.Router` under
:data:`ROUTER`; other modules add their routes to that app (``add_conversion_routes(app)``,
``add_dashboard_routes(app)``). Run it with :func:`start_server` (tests, demo) or
:func:`run_server` (the CLI); both enable handler cancellation so a client that goes away
cancels its request and the workers get ``/abort_request``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from pd_router import info, proxy, workers_api
from pd_router.auth import is_admin_path, require_admin
from pd_router.config import RouterConfig
from pd_router.conversion_api import add_conversion_routes
from pd_router.dashboard import add_dashboard_routes
from pd_router.errors import RouterError, error_response
from pd_router.metrics import RouterMetrics
from pd_router.state import REQUEST_ID, ROUTER, UPSTREAM_ID, Router
from pd_router.workers import RegistryError

log = logging.getLogger("pd_router.server")

MAX_REQUEST_ID_LENGTH = 128

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

__all__ = ["ROUTER", "Router", "RunningServer", "build_app", "run_server", "start_server"]


class RequestIds:
    """Fresh request ids: 96 random bits from the operating system's CSPRNG, as 24 hex digits.

    A router-made id is also the ``rid`` workers know the request by, and a rid is all
    ``/abort_request`` needs, so an id must not be guessable from the ids a client has seen
    (``X-Request-Id``). The random bytes are drawn in blocks, one ``os.urandom`` call per
    :data:`BLOCK_IDS` ids, which keeps an id as cheap as a formatted counter.
    """

    ID_BYTES = 12
    BLOCK_IDS = 170

    def __init__(self) -> None:
        self._block = ""
        self._next = 0

    def next(self) -> str:
        start = self._next
        if start >= len(self._block):
            self._block = os.urandom(self.ID_BYTES * self.BLOCK_IDS).hex()
            start = 0
        self._next = end = start + 2 * self.ID_BYTES
        return self._block[start:end]


REQUEST_IDS = web.AppKey("request_ids", RequestIds)


def request_ids(request: web.Request, ids: RequestIds) -> tuple[str, str]:
    """(request id, upstream id): the client's X-Request-Id when it is sane, else a fresh one.
    A client's id gets a fresh suffix upstream, so its rid is no easier to guess than ours."""
    given = request.headers.get("X-Request-Id")
    if given and len(given) <= MAX_REQUEST_ID_LENGTH and given.isascii() and given.isprintable():
        return given, f"{given}-{ids.next()}"
    fresh = ids.next()
    return fresh, fresh


def endpoint_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def core_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id in and out, admin auth, one mapping from errors to JSON responses, and the
    request metrics for every endpoint."""
    router = request.app[ROUTER]
    loop = asyncio.get_running_loop()
    started = loop.time()
    request_id, upstream_id = request_ids(request, request.app[REQUEST_IDS])
    request[REQUEST_ID] = request_id
    request[UPSTREAM_ID] = upstream_id
    try:
        if router.config.admin_api_key is not None and is_admin_path(request.path):
            require_admin(request)
        response = await handler(request)
    except asyncio.CancelledError:
        router.observe_request(endpoint_label(request), 499, loop.time() - started)
        raise
    except (RouterError, RegistryError, web.HTTPException) as exc:
        response = error_response(exc)
    except Exception:
        log.exception("unhandled error", extra={"request_id": request_id, "path": request.path})
        response = error_response(RouterError("internal router error"))
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    router.observe_request(endpoint_label(request), response.status, loop.time() - started)
    return response


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/generate", proxy.handle_generate)
    r.add_post("/v1/completions", proxy.handle_completions)
    r.add_post("/v1/chat/completions", proxy.handle_chat)
    r.add_get("/health", info.handle_health)
    r.add_get("/readiness", info.handle_readiness)
    r.add_get("/health_generate", info.handle_health_generate)
    r.add_get("/metrics", info.handle_metrics)
    r.add_get("/v1/models", info.handle_models)
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
    r.add_delete("/workers/{key:.+}", workers_api.handle_remove_worker)


async def _on_startup(app: web.Application) -> None:
    await app[ROUTER].start()


async def _on_cleanup(app: web.Application) -> None:
    await app[ROUTER].stop()


def build_app(config: RouterConfig, metrics: RouterMetrics | None = None) -> web.Application:
    """The router application for ``config`` (workers registered, not yet probed)."""
    app = web.Application(middlewares=[core_middleware], client_max_size=config.max_payload_size)
    app[ROUTER] = Router(config, metrics)
    app[REQUEST_IDS] = RequestIds()
    add_routes(app)
    add_dashboard_routes(app)
    app.on_startup.append(_on_startup)
    app.on_cleanup.append(_on_cleanup)
    add_conversion_routes(app)
    return app


@dataclass
class RunningServer:
    """An application serving on a port; ``url`` is where to reach it."""

    app: web.Application
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def router(self) -> Router:
        return self.app[ROUTER]

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_server(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> RunningServer:
    """Serve ``app`` in the running loop (port 0: a free port); stop with ``.stop()``."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    server = runner.addresses[0]
    return RunningServer(app, runner, host, server[1])


def tune_gc() -> None:
    """Every request leaves short-lived cycles (tasks, futures, responses); with the default
    thresholds the collector ran often enough to take a fifth of the router's CPU. Freeze what
    start-up allocated and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 50, 100)


def run_server(config: RouterConfig) -> None:
    """Serve until interrupted (the CLI's ``serve``), on uvloop when available."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    app = build_app(config)
    tune_gc()
    web.run_app(
        app,
        host=config.host,
        port=config.port,
        handler_cancellation=True,
        access_log=None,
        backlog=1024,
        print=lambda msg: log.info(msg.strip()),
        loop=uvloop.new_event_loop() if uvloop is not None else None,
    )
