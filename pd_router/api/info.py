"""Router-level endpoints that are not the PD request path: liveness, readiness, metrics, model
and server info (aggregated per pool), and the fan-out operations (flush_cache, abort_request,
health_generate) that SGLang clients and benchmark scripts call on a router as on a server.

``/flush_cache`` and ``/abort_request`` with ``abort_all`` are admin calls (the key is checked
by the middleware and by :func:`handle_abort_request`). Aborting one request stays open to
whoever knows its rid: the router's rids are random, and SGLang aborts every request whose rid
*starts with* the one given, so an abort without the key must name a rid too long to be a
prefix of anyone else's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from pd_router.api.auth import has_admin_key, require_admin
from pd_router.api.keys import CLUSTER, DATAPLANES, METRICS, REGISTRY, SESSION
from pd_router.control.worker_calls import CallReply, call, fan_out
from pd_router.control.workers import Role, Worker, WorkerRegistry, WorkerState
from pd_router.dataplane.path.requests import parse_body
from pd_router.errors import BadRequest, ModelNotFound, NoWorkers, UpstreamError
from pd_router.roles import PD_ROLES

INFO_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
# mini_lb's stand-in when no decode reported its state: SGLang's bench_one_batch_server reads
# ``internal_states[0]`` unconditionally.
NO_DECODE_STATE: Mapping[str, Any] = MappingProxyType(
    {"last_gen_throughput": 0.0, "avg_spec_accept_length": None}
)
# SGLang's /server_info serialises all its server arguments, credentials included; the router
# calls workers with their key, so it must not hand those on.
SECRET_SERVER_ARGS = frozenset({"api_key", "admin_api_key", "ssl_keyfile_password"})
SECRET_SUFFIXES = ("_api_key", "_password", "_secret")
REDACTED = "<redacted>"
# Shortest rid an abort without the admin key may name (64 bits as hex digits).
MIN_ABORT_RID_LENGTH = 16


def json_response(
    data: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(data), status=status, content_type="application/json", headers=headers
    )


def active_workers(registry: WorkerRegistry) -> list[Worker]:
    return [w for w in registry if w.state is WorkerState.ACTIVE]


async def handle_health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def handle_readiness(request: web.Request) -> web.Response:
    """200 when the router can route a request (an ACTIVE, healthy, admitting worker in each
    pool), 503 otherwise. Either way the body names the ACTIVE workers that fail their
    probes, so a worker that never answered is visible while its pool still has others."""
    registry = request.app[REGISTRY]
    counts = {role.value: registry.active_healthy_count(role) for role in registry.roles()}
    unhealthy = [
        {"url": w.url, "role": w.role.value, "error": w.last_error}
        for w in registry
        if w.state is WorkerState.ACTIVE and not w.healthy
    ]
    names = registry.models()
    if len(names) > 1:
        models = {model: model_readiness(registry, model) for model in names}
        ready = all(entry["ready"] for entry in models.values())
    else:
        models = {}
        ready = bool(names) and model_readiness(registry, None)["ready"]
    body: dict[str, Any] = {
        "ready": ready,
        "status": "ready" if ready else "not ready",
        "healthy": counts,
        "unhealthy": unhealthy,
    }
    if models:
        body["models"] = models
    return json_response(body, 200 if ready else 503)


def model_readiness(registry: WorkerRegistry, model: str | None) -> dict:
    """Whether ``model`` (None: the only one, all workers) can be served (a PD model: an
    active healthy prefill and decode; a model of regular workers only: one of them), with its
    counts."""
    counts = {role.value: registry.active_healthy_count(role, model=model) for role in Role}
    if any(registry.in_role(role, model=model) for role in PD_ROLES):
        ready = all(counts[role.value] for role in PD_ROLES)
    else:
        ready = counts[Role.REGULAR.value] > 0
    return {"ready": ready, "healthy": counts}


async def handle_cluster(request: web.Request) -> web.Response:
    """The router replicas this one agrees with (``{"enabled": false}`` for a router alone)."""
    return json_response(request.app[CLUSTER].as_dict())


async def handle_metrics(request: web.Request) -> web.Response:
    """The router's metrics, each data-plane process's counters and histograms added to the
    control process's own (one scrape shows the whole router)."""
    collected = await request.app[DATAPLANES].collect_metrics()
    body, content_type = request.app[METRICS].exposition(collected)
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def handle_health_generate(request: web.Request) -> web.Response:
    """200 when every active worker passes its own /health_generate."""
    workers = active_workers(request.app[REGISTRY])
    if not workers:
        raise NoWorkers("no active workers")
    replies = await fan_out(request.app[SESSION], workers, "GET", "/health_generate")
    healthy = all(r.ok for r in replies)
    return json_response(
        {"healthy": healthy, "workers": [r.summary() for r in replies]}, 200 if healthy else 503
    )


async def first_answer(request: web.Request, path: str, model: str | None = None) -> web.Response:
    """A selectable worker's answer to ``GET path`` (of ``model`` when given; prefill first,
    then decode, then regular: they serve the same model)."""
    registry = request.app[REGISTRY]
    candidates = [w for role in Role for w in registry.selectable(role, model)]
    if not candidates:
        raise NoWorkers("no available worker to ask")
    errors = []
    for worker in candidates[:3]:
        reply = await call(request.app[SESSION], worker, "GET", path, limit=INFO_TIMEOUT)
        if reply.ok:
            return web.Response(body=reply.body, status=200, content_type="application/json")
        errors.append(reply.error or f"{worker.url} answered {reply.status}")
    raise UpstreamError(f"GET {path} failed: " + "; ".join(errors))


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: a worker's listing; serving several models, one listing per model
    (a worker of each) in one list."""
    models = request.app[REGISTRY].models()
    if len(models) <= 1:
        return await first_answer(request, "/v1/models")
    data: list = []
    for model in models:
        if model:
            data.extend(await model_objects(request, model))
    return json_response({"object": "list", "data": data})


async def model_objects(request: web.Request, model: str | None = None) -> list:
    """The model objects of a worker's ``/v1/models`` (of ``model`` when given)."""
    listing = await first_answer(request, "/v1/models", model)
    try:
        models = orjson.loads(listing.body)
    except orjson.JSONDecodeError:
        raise UpstreamError("GET /v1/models answered something that is not JSON") from None
    data = models.get("data") if isinstance(models, dict) else None
    return [model for model in data if isinstance(model, dict)] if isinstance(data, list) else []


async def handle_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}``: the model object of a worker's ``/v1/models`` with that id
    (ids may hold slashes; of the workers serving that model when several are served), 404
    ``model_not_found`` otherwise."""
    model_id = request.match_info["model_id"]
    models = request.app[REGISTRY].models()
    if len(models) > 1 and model_id not in models:
        raise ModelNotFound(model_id)
    for model in await model_objects(request, model_id if len(models) > 1 else None):
        if model.get("id") == model_id:
            return json_response(model)
    raise ModelNotFound(model_id)


async def handle_model_info(request: web.Request) -> web.Response:
    return await first_answer(request, "/model_info")


async def handle_server_info(request: web.Request) -> web.Response:
    """Every worker's /server_info grouped by pool; the decodes' ``internal_states`` at the top
    (where SGLang's benchmark scripts look for them), as mini_lb does."""
    registry = request.app[REGISTRY]
    workers = list(registry)
    replies = await fan_out(
        request.app[SESSION], workers, "GET", "/server_info", limit=INFO_TIMEOUT
    )
    pools: dict[str, list] = {role.value: [] for role in registry.roles()}
    internal_states: list = []
    for reply in replies:
        entry = parse_info(reply)
        pools[reply.worker.role.value].append(entry)
        states = entry.get("internal_states")
        if reply.worker.role is Role.DECODE and isinstance(states, list):
            internal_states.extend(states)
    return json_response({**pools, "internal_states": internal_states or [dict(NO_DECODE_STATE)]})


def parse_info(reply: CallReply) -> dict:
    if not reply.ok:
        return reply.summary()
    try:
        info = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return {**reply.summary(), "error": "server_info is not JSON"}
    if not isinstance(info, dict):
        return {**reply.summary(), "error": "server_info is not an object"}
    return {**redact_secrets(info), "url": reply.worker.url}


def redact_secrets(info: dict) -> dict:
    """``info`` with the values of credential arguments replaced, at the top level and in each
    ``internal_states`` entry: SGLang puts its server arguments in both."""
    redacted = {
        key: REDACTED if value is not None and is_secret_arg(key) else value
        for key, value in info.items()
    }
    states = redacted.get("internal_states")
    if isinstance(states, list):
        redacted["internal_states"] = [
            redact_secrets(state) if isinstance(state, dict) else state for state in states
        ]
    return redacted


def is_secret_arg(name: str) -> bool:
    return name in SECRET_SERVER_ARGS or name.endswith(SECRET_SUFFIXES)


async def handle_flush_cache(request: web.Request) -> web.Response:
    """Fan out /flush_cache (with its ``timeout``) to every active worker."""
    params = {"timeout": request.query["timeout"]} if "timeout" in request.query else None
    replies = await fan_out(
        request.app[SESSION],
        active_workers(request.app[REGISTRY]),
        "POST",
        "/flush_cache",
        params=params,
    )
    return summarize(replies)


async def handle_abort_request(request: web.Request) -> web.Response:
    """Fan out /abort_request to every active worker (the rid lives on one P and one D)."""
    body = parse_body(await request.read())
    check_abort(request, body)
    replies = await fan_out(
        request.app[SESSION],
        active_workers(request.app[REGISTRY]),
        "POST",
        "/abort_request",
        data=orjson.dumps(body),
    )
    return summarize(replies)


def check_abort(request: web.Request, body: dict[str, Any]) -> None:
    """``abort_all`` (any value but false) needs the admin key; without the key, the rid must
    be a string of at least :data:`MIN_ABORT_RID_LENGTH` characters."""
    if body.get("abort_all") not in (None, False):
        require_admin(request)
        return
    if has_admin_key(request):
        return
    rid = body.get("rid")
    if not isinstance(rid, str) or len(rid) < MIN_ABORT_RID_LENGTH:
        raise BadRequest(
            f"'rid' must be a string of at least {MIN_ABORT_RID_LENGTH} characters to abort "
            "without the admin key (workers abort every rid that starts with it)",
            details={"field": "rid"},
        )


def summarize(replies: list[CallReply]) -> web.Response:
    """200 when every worker succeeded; else a worker's own 4xx, or 502 for transport errors."""
    success = all(r.ok for r in replies)
    if success:
        status = 200
    else:
        failed = [r.status for r in replies if not r.ok]
        status = next((s for s in failed if s is not None and 400 <= s < 500), 502)
    return json_response({"success": success, "workers": [r.summary() for r in replies]}, status)
