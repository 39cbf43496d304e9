"""The extension endpoints on a FastAPI app (SGLang's own `app` in production).

Maps `GET /pd_role`, `POST /pd_drain`, `POST /convert_pd_role`, `POST /pd_forget_prefill` and
`POST /pd_role_switch` onto `PDExtension` and adds the admission middleware. `/pd_role_switch`
is put in front of SGLang's native route, so that a direct switch is serialized with
conversions and counted in the epoch; it forwards the same body to SGLang's tokenizer manager.
Errors are mapped to HTTP here only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pd_protocol.extension import ExtensionError, PDExtension
from pd_protocol.wire import (
    CONVERT_PATH,
    DRAIN_PATH,
    FORGET_PREFILL_PATH,
    ROLE_PATH,
    SWITCH_PATH,
)
from server_patch.admission import AdmissionMiddleware, InFlight

Handler = Callable[[Request], Awaitable[Response]]


def install(
    app: FastAPI,
    extension: PDExtension,
    in_flight: InFlight,
    *,
    control_auth: Callable[[Handler], Handler] = lambda handler: handler,
) -> None:
    """Add the routes and the admission middleware; call before the app serves its first request.

    `control_auth` marks the state-changing handlers the way the host server marks its admin
    routes (SGLang: `auth_level(AuthLevel.ADMIN_OPTIONAL)`).
    """

    async def pd_role(request: Request) -> Response:
        return _json(200, await extension.status())

    async def pd_drain(request: Request) -> Response:
        return await _answer(request, lambda body: _ok(extension.set_drain(body)))

    async def convert_pd_role(request: Request) -> Response:
        return await _answer(request, extension.convert)

    async def pd_role_switch(request: Request) -> Response:
        return await _answer(request, extension.switch)

    async def pd_forget_prefill(request: Request) -> Response:
        return await _answer(request, lambda body: _ok(extension.forget_prefill(body)))

    app.add_api_route(ROLE_PATH, pd_role, methods=["GET"])
    app.add_api_route(DRAIN_PATH, control_auth(pd_drain), methods=["POST"])
    app.add_api_route(CONVERT_PATH, control_auth(convert_pd_role), methods=["POST"])
    app.add_api_route(FORGET_PREFILL_PATH, control_auth(pd_forget_prefill), methods=["POST"])
    app.add_api_route(SWITCH_PATH, control_auth(pd_role_switch), methods=["POST"])
    app.router.routes.insert(0, app.router.routes.pop())
    app.add_middleware(AdmissionMiddleware, extension=extension, in_flight=in_flight)


async def _ok(result: Awaitable[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    return 200, await result


async def _answer(
    request: Request, call: Callable[[Any], Awaitable[tuple[int, dict[str, Any]]]]
) -> Response:
    """Parse the JSON body (empty means `{}`), call the extension, map ExtensionError to 4xx."""
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError:
        return _json(
            400, {"success": False, "message": "request body is not valid JSON", "field": None}
        )
    try:
        status, reply = await call(body)
    except ExtensionError as refused:
        return _json(refused.status, refused.body)
    return _json(status, reply)


def _json(status: int, body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")
