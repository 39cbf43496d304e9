"""CORS: lets browser pages from the configured origins call the router
(``cors_allowed_origins``; ``"*"`` allows any origin). With the list empty nothing is added.

Two parts, because an answer may already be on its way (a stream) when a handler returns:

- :func:`cors_middleware`, the outermost middleware, answers a preflight (``OPTIONS`` with
  ``Access-Control-Request-Method``) itself: before routing's 405, before admin auth (a
  browser never sends credentials with a preflight), before any metric or body admission.
  A preflight from an origin not on the list gets 403.
- :func:`add_cors_headers`, a response-prepare hook, adds ``Access-Control-Allow-Origin``
  to every answer to an allowed origin, streams and errors included. An answer to another
  origin goes out without it, so the browser keeps it from the page.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from pd_router.dataplane.front.cors import EXPOSED_HEADERS, CorsPolicy
from pd_router.errors import json_error

ALLOWED_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
PREFLIGHT_MAX_AGE_SECS = "3600"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


CORS_POLICY = web.AppKey("cors_policy", CorsPolicy)


def is_preflight(request: web.BaseRequest) -> bool:
    return (
        request.method == hdrs.METH_OPTIONS
        and hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers
    )


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer preflights; pass everything else on."""
    if not is_preflight(request):
        return await handler(request)
    allowed = request.app[CORS_POLICY].allow_origin(request.headers.get(hdrs.ORIGIN))
    if allowed is None:
        return json_error(403, "forbidden", "origin not allowed (cors_allowed_origins)")
    headers = {
        hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: allowed,
        hdrs.ACCESS_CONTROL_ALLOW_METHODS: ALLOWED_METHODS,
        hdrs.ACCESS_CONTROL_MAX_AGE: PREFLIGHT_MAX_AGE_SECS,
        hdrs.VARY: "Origin",
    }
    asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS)
    if asked:
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked
    return web.Response(status=204, headers=headers)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``Access-Control-Allow-Origin`` on an answer to an allowed origin (preflights have
    theirs already)."""
    if is_preflight(request):
        return
    allowed = request.app[CORS_POLICY].allow_origin(request.headers.get(hdrs.ORIGIN))
    if allowed is not None:
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = allowed
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = EXPOSED_HEADERS
        response.headers.add(hdrs.VARY, "Origin")


def add_cors(app: web.Application, origins: tuple[str, ...]) -> None:
    """CORS for ``origins`` on ``app`` (nothing when the list is empty). Must run before the
    application is frozen, with the middleware list still open."""
    if not origins:
        return
    app[CORS_POLICY] = CorsPolicy(origins)
    app.middlewares.insert(0, cors_middleware)
    app.on_response_prepare.append(add_cors_headers)
