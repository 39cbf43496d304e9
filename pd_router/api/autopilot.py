"""HTTP admin API of the autopilot: ``GET /autopilot`` (mode, targets, the signals it saw, its
last decisions with their reasons) and ``PUT /autopilot`` (change mode and targets)."""

from __future__ import annotations

from aiohttp import web

from pd_router.api.info import json_response
from pd_router.api.keys import AUTOPILOT
from pd_router.config import ConfigError
from pd_router.dataplane.path.requests import parse_admin_body
from pd_router.errors import BadRequest


class InvalidSetting(BadRequest):
    """A 400 about one autopilot key; the reply names it in ``field``."""

    def __init__(self, error: ConfigError) -> None:
        super().__init__(str(error), details={"field": error.key})


def add_autopilot_routes(app: web.Application) -> None:
    app.router.add_get("/autopilot", get_autopilot)
    app.router.add_put("/autopilot", put_autopilot)


async def get_autopilot(request: web.Request) -> web.Response:
    return json_response(request.app[AUTOPILOT].to_json())


async def put_autopilot(request: web.Request) -> web.Response:
    """Apply the keys of the body's JSON object (those of ``[autopilot]``) and answer with
    the new state."""
    autopilot = request.app[AUTOPILOT]
    try:
        autopilot.configure(parse_admin_body(await request.read()))
    except ConfigError as exc:
        raise InvalidSetting(exc) from exc
    return json_response(autopilot.to_json())
