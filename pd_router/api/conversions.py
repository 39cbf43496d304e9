"""HTTP admin API of role conversion: ``/convert_pd_role``, ``/pd_role_switch``, ``/conversions``.

``POST /convert_pd_role`` is the router's own shape (the SGLang PR #9325 body plus ``wait``);
``POST /pd_role_switch`` takes exactly SGLang mini_lb's body and answers with its status codes
(200 and the worker's reply, 400 and the worker's reply on failure), so scripts written for
mini_lb keep working. Both run the same :class:`ConversionManager`. Errors are raised as the
router's HTTP errors or the control plane's refusals, and turned into responses by the error
middleware (:mod:`pd_router.api.errors`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from pd_protocol.json_values import is_int, is_number
from pd_protocol.wire import UNSUPPORTED_KNOBS
from pd_router.api.info import json_response
from pd_router.api.keys import CONVERSIONS
from pd_router.control.conversion.history import Conversion, ConversionRequest, Status
from pd_router.control.errors import AlreadyInRole
from pd_router.control.workers import Role
from pd_router.dataplane.path.requests import parse_admin_body
from pd_router.errors import BadRequest

ABORT_REPLY_WAIT_SECS = 5.0
DEFAULT_LIST_LIMIT = 50

# SGLang PR #9325 knobs, as the extension's wire contract lists them: passed on to workers whose
# control API takes them (the extension's /convert_pd_role decides), refused with a 400 naming
# the field for native workers. A knob that is null or false asks for nothing and is dropped.
PASS_THROUGH_FIELDS = UNSUPPORTED_KNOBS | {"check_idle"}
CONVERT_FIELDS = frozenset(
    {
        "server_url",
        "worker_url",
        "new_role",
        "disaggregation_mode",
        "drain_timeout_secs",
        "decode_cuda_graph_bs",
        "decode_cuda_graph_memory_gb",
        "bootstrap_port",
        "disaggregation_bootstrap_port",
        "drain",
        "wait",
    }
)
MINI_LB_FIELDS = frozenset(
    {
        "worker_url",
        "new_role",
        "bootstrap_port",
        "decode_cuda_graph_bs",
        "decode_cuda_graph_memory_gb",
        "drain",
        "drain_timeout_secs",
    }
)


def add_conversion_routes(app: web.Application) -> None:
    """Register the conversion routes (the manager is the application's ``CONVERSIONS``)."""
    app.router.add_post("/convert_pd_role", convert_pd_role)
    app.router.add_post("/pd_role_switch", pd_role_switch)
    app.router.add_get("/conversions", list_conversions)
    app.router.add_get("/conversions/{id}", get_conversion)
    app.router.add_delete("/conversions/{id}", abort_conversion)


class InvalidField(BadRequest):
    """A 400 about one field of the body or query; the reply names it in ``field``."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message, details={"field": name})
        self.field = name


# --- handlers -------------------------------------------------------------------------------


async def convert_pd_role(request: web.Request) -> web.Response:
    """Start a conversion; with ``wait`` (default true) answer when it has ended."""
    body = parse_admin_body(await request.read())
    _check_known(body, CONVERT_FIELDS | PASS_THROUGH_FIELDS)
    wait = _bool(body, "wait", True)
    conversion_request = parse_convert_body(body)
    conversion = await request.app[CONVERSIONS].start(conversion_request)
    location = f"/conversions/{conversion.id}"
    if not wait:
        return json_response(
            {"id": conversion.id, "status": conversion.status.value, "location": location},
            status=202,
            headers={"Location": location},
        )
    await conversion.wait()
    return json_response(conversion.as_dict(), status=200 if conversion.succeeded else 400)


async def pd_role_switch(request: web.Request) -> web.Response:
    """SGLang mini_lb's ``/pd_role_switch``: same body, same status codes."""
    body = parse_admin_body(await request.read())
    _check_known(body, MINI_LB_FIELDS)
    worker_url = body.get("worker_url")
    if not isinstance(worker_url, str) or not worker_url:
        raise InvalidField("worker_url", "worker_url is required")
    new_role = body.get("new_role")
    if new_role not in ("prefill", "decode"):
        raise InvalidField("new_role", f"invalid new_role={new_role!r}")
    conversion_request = ConversionRequest(
        worker=worker_url,
        new_role=Role(new_role),
        drain=_bool(body, "drain", True),
        drain_timeout_secs=_number(body, "drain_timeout_secs"),
        decode_cuda_graph_bs=_graph_bs(body),
        decode_cuda_graph_memory_gb=_number(body, "decode_cuda_graph_memory_gb"),
        bootstrap_port=_port(body, "bootstrap_port"),
    )
    try:
        conversion = await request.app[CONVERSIONS].start(conversion_request)
    except AlreadyInRole as exc:
        return json_response(
            {
                "success": True,
                "message": "already in target role",
                "old_role": exc.worker.role.value,
                "new_role": new_role,
                "safe_to_restore": False,
            }
        )
    await conversion.wait()
    status, reply = mini_lb_reply(conversion)
    return json_response(reply, status=status)


async def list_conversions(request: web.Request) -> web.Response:
    limit = _query_int(request, "limit", DEFAULT_LIST_LIMIT)
    manager = request.app[CONVERSIONS]
    records = [c.as_dict() for _, c in zip(range(limit), manager.history(), strict=False)]
    return json_response({"active": [c.id for c in manager.active()], "conversions": records})


async def get_conversion(request: web.Request) -> web.Response:
    return json_response(request.app[CONVERSIONS].get(request.match_info["id"]).as_dict())


async def abort_conversion(request: web.Request) -> web.Response:
    """Abort a draining conversion; answers once the worker is back in its old pool."""
    conversion = request.app[CONVERSIONS].abort(request.match_info["id"])
    try:
        await asyncio.wait_for(asyncio.shield(conversion.wait()), ABORT_REPLY_WAIT_SECS)
    except TimeoutError:
        return json_response(conversion.as_dict(), status=202)
    return json_response(conversion.as_dict())


# --- replies --------------------------------------------------------------------------------


# Worker replies a conversion records that are checks of the switch, not switch calls.
CHECKS = frozenset({"verify", "canary"})


def mini_lb_reply(conversion: Conversion) -> tuple[int, dict[str, Any]]:
    """The worker's last switch reply with its status, as mini_lb relays it; a 400 reply in the
    same shape when the conversion ended before or after the switch call, or the switch call got
    no reply (mini_lb answers 400 for a lost connection too)."""
    switch_replies = [r for r in conversion.worker_replies if r["call"] not in CHECKS]
    last = switch_replies[-1] if switch_replies else None
    if conversion.succeeded and last is not None:
        return 200, last["body"]
    if (
        last is not None
        and last["status"] is not None
        and not _reply_succeeded(last)
        and conversion.status is not Status.ABORTED
    ):
        return last["status"], last["body"]
    return 400, {
        "success": False,
        "message": conversion.message,
        "old_role": conversion.from_role.value,
        "new_role": conversion.to_role.value,
        "safe_to_restore": conversion.status is not Status.FAILED,
    }


def _reply_succeeded(entry: dict[str, Any]) -> bool:
    body = entry["body"]
    return entry["status"] == 200 and isinstance(body, dict) and bool(body.get("success"))


# --- parsing --------------------------------------------------------------------------------


def parse_convert_body(body: dict[str, Any]) -> ConversionRequest:
    """The router's /convert_pd_role body (PR #9325 shape accepted) as a ConversionRequest."""
    worker = body.get("server_url", body.get("worker_url"))
    if not isinstance(worker, str) or not worker:
        raise InvalidField("server_url", "server_url is required")
    role = _role(body, "new_role")
    alias = _role(body, "disaggregation_mode")
    if role is not None and alias is not None and role is not alias:
        raise InvalidField("new_role", "new_role and disaggregation_mode name different roles")
    port = _port(body, "bootstrap_port")
    alias_port = _port(body, "disaggregation_bootstrap_port")
    return ConversionRequest(
        worker=worker,
        new_role=role or alias,
        drain=_bool(body, "drain", True),
        drain_timeout_secs=_number(body, "drain_timeout_secs"),
        decode_cuda_graph_bs=_graph_bs(body),
        decode_cuda_graph_memory_gb=_number(body, "decode_cuda_graph_memory_gb"),
        bootstrap_port=port if port is not None else alias_port,
        extra={
            k: v
            for k, v in body.items()
            if k in PASS_THROUGH_FIELDS and v is not None and v is not False
        },
    )


def _check_known(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name in body:
        if name not in allowed:
            raise InvalidField(name, f"unknown field {name!r}")


def _role(body: dict[str, Any], name: str) -> Role | None:
    value = body.get(name)
    if value is None:
        return None
    if value not in ("prefill", "decode"):
        raise InvalidField(name, f"{name} must be 'prefill' or 'decode'")
    return Role(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidField(name, f"{name} must be true or false")
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or value < 0:
        raise InvalidField(name, f"{name} must be a non-negative number")
    return float(value)


def _port(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or not 0 < value < 65536:
        raise InvalidField(name, f"{name} must be a port number")
    return value


def _graph_bs(body: dict[str, Any]) -> list[int] | None:
    value = body.get("decode_cuda_graph_bs")
    if value is None:
        return None
    if not isinstance(value, list) or not all(is_int(bs) and bs > 0 for bs in value):
        raise InvalidField(
            "decode_cuda_graph_bs", "decode_cuda_graph_bs must be a list of positive integers"
        )
    return value


def _query_int(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise InvalidField(name, f"{name} must be an integer") from exc
    if value < 0:
        raise InvalidField(name, f"{name} must not be negative")
    return value
