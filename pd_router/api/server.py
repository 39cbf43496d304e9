"""The router's aiohttp application: its routes and the middleware (request id, admin auth,
body size, error mapping, request metrics; CORS in front when configured).

:func:`application` returns the Application with every route; the handlers of each area add
theirs (``add_conversion_routes(app)``, ``add_dashboard_routes(app)``) and read the
collaborators they need under :mod:`pd_router.api.keys`, which the composition root
(:func:`pd_router.runtime.router.build_app`) fills. Clients connect to a data plane's front
(:mod:`pd_router.dataplane.front`), which serves the generation endpoints itself and relays
every other request here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from pd_router.api import engine_metrics, info, loads
from pd_router.api import workers as workers_api
from pd_router.api.auth import is_admin_path, require_admin
from pd_router.api.autopilot import add_autopilot_routes
from pd_router.api.conversions import add_conversion_routes
from pd_router.api.cors import add_cors
from pd_router.api.dashboard import add_dashboard_routes
from pd_router.api.errors import MAPPED_ERRORS, error_response
from pd_router.config import RouterConfig
from pd_router.dataplane.front.admission import BodyAdmission
from pd_router.dataplane.front.ids import RequestIds
from pd_router.dataplane.path.collaborators import RequestMetrics
from pd_router.errors import ClientClosedRequest, RouterError

log = logging.getLogger("pd_router.api.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

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


def application(config: RouterConfig, request_metrics: RequestMetrics) -> web.Application:
    """The application's routes and middleware for ``config``; the collaborators its handlers
    read are stored under :mod:`pd_router.api.keys` by the caller."""
    app = web.Application(middlewares=[core_middleware], client_max_size=config.max_payload_size)
    app[REQUEST_METRICS] = request_metrics
    app[REQUEST_IDS] = RequestIds(config.request_id_headers)
    app[BODY_ADMISSION] = BodyAdmission(config.max_payload_size, config.max_inflight_body_bytes)
    add_cors(app, config.cors_allowed_origins)
    add_routes(app)
    add_dashboard_routes(app)
    add_conversion_routes(app)
    add_autopilot_routes(app)
    return app
