"""HTTP admin API of the autopilot: ``GET /autopilot`` (mode, targets, the signals it saw, its
last decisions with their reasons) and ``PUT /autopilot`` (change mode and targets)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from pd_router.config import ConfigError
from pd_router.errors import BadRequest
from pd_router.state import router_of


class InvalidSetting(BadRequest):
    """A 400 about one autopilot key; the reply names it in ``field``."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error), details={"field": error.key})


def add_autopilot_routes(app: web.Application) -> None:
    app.router.add_get("/autopilot", get_autopilot)
    app.router.add_put("/autopilot", put_autopilot)


async def get_autopilot(request: web.Request) -> web.Response:
    return _json(router_of(request).autopilot.to_json())


async def put_autopilot(request: web.Request) -> web.Response:
    """Apply the keys of the body's JSON object (those of ``[autopilot]``) and answer with
    the new state."""
    autopilot = router_of(request).autopilot
    try:
        autopilot.configure(await _json_object(request))
    except ConfigError as exc:
        raise InvalidSetting(exc) from exc
    return _json(autopilot.to_json())


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
