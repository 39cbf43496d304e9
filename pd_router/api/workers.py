"""Admin API for the pools: list, read, add and remove workers.

With router replicas (``[cluster]``) an addition or a removal is published to the others first
(503 while etcd cannot be reached), so it shows on every replica.

Removal stops routing to the worker at once (REMOVING), waits for the router's in-flight
requests on it to end (an event, bounded by ``worker_removal_timeout_secs``), then forgets it. The
registry refuses it (409) while a conversion holds the worker, and refuses a conversion of a
worker being removed. The removal runs to the end even if the admin client disconnects, so a
worker is never left half-removed.
"""

from __future__ import annotations

from aiohttp import web

from pd_router.api.info import json_response
from pd_router.api.keys import CLUSTER, CONFIG, HEALTH, REGISTRY, REMOVE_WORKER
from pd_router.config import ConversionConfig
from pd_router.control.workers import (
    Role,
    Worker,
    WorkerConverting,
    WorkerRegistry,
    WorkerRemoving,
    WorkerState,
    normalize_url,
)
from pd_router.dataplane.path.requests import is_int, parse_body
from pd_router.errors import BadRequest, Conflict


async def handle_list_workers(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    return json_response(
        {
            "workers": [w.as_dict() for w in registry],
            "selectable": {role.value: len(registry.selectable(role)) for role in registry.roles()},
        }
    )


async def handle_get_worker(request: web.Request) -> web.Response:
    """One worker's record by id or url (sglang-router's and smg's ``GET /workers/{id}``);
    404 for an unknown worker."""
    worker = request.app[REGISTRY].get(request.match_info["key"])
    return json_response(worker.as_dict())


def parse_new_worker(body: dict) -> tuple[str, Role, int | None, str | None]:
    url = body.get("url")
    if not isinstance(url, str):
        raise BadRequest("'url' (string) is required")
    try:
        url = normalize_url(url)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    role_name = body.get("role")
    try:
        role = Role(role_name)
    except ValueError:
        raise BadRequest(
            f"'role' must be 'prefill', 'decode' or 'regular', got {role_name!r}"
        ) from None
    port = body.get("bootstrap_port")
    if port is not None and not (is_int(port) and 0 < port < 65536):
        raise BadRequest(f"'bootstrap_port' must be a port number 1..65535, got {port!r}")
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and model.strip()):
        raise BadRequest(f"'model' must name a model, got {model!r}")
    return url, role, port, model


async def handle_add_worker(request: web.Request) -> web.Response:
    """Register a worker, probe it once, answer with its record (409 if already known). The
    model it serves is the one given, else the one its ``/server_info`` names."""
    url, role, port, model = parse_new_worker(parse_body(await request.read()))
    worker = await request.app[CLUSTER].add_worker(url, role, port)
    if model is not None:
        request.app[REGISTRY].set_model(worker, model)
    await request.app[HEALTH].check(worker)
    return json_response(worker.as_dict(), 201)


async def handle_remove_worker(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    key = request.match_info.get("key") or request.query.get("url")
    if not key:
        raise BadRequest("name the worker: DELETE /workers/{id-or-url} or ?url=")
    worker = registry.get(key)
    if request.query.get("force") not in ("1", "true"):
        refuse_below_minimum(request.app[CONFIG].conversion, registry, worker)
    try:
        await request.app[CLUSTER].begin_removal(worker)
    except (WorkerConverting, WorkerRemoving) as exc:
        raise Conflict(str(exc), details={"reason": exc.reason}) from exc
    forced = await request.app[REMOVE_WORKER](worker)
    return json_response({"removed": worker.as_dict(), "forced": forced})


def refuse_below_minimum(
    settings: ConversionConfig, registry: WorkerRegistry, worker: Worker
) -> None:
    """409 when removing ``worker`` would leave its pool fewer active healthy workers than its
    minimum (``conversion.min_prefill`` / ``min_decode``, which guard conversions too); a worker
    that is not one of them (unhealthy, failed) can always go. Checked right before the removal
    begins, with no await between the two."""
    if worker.role is Role.REGULAR or not (
        worker.state is WorkerState.ACTIVE and worker.healthy and worker.admitting
    ):
        return
    minimum = settings.min_prefill if worker.role is Role.PREFILL else settings.min_decode
    remaining = registry.remaining_below(worker, minimum)
    if remaining is not None:
        raise Conflict(
            f"removing {worker.url} would leave {remaining} active healthy {worker.role} "
            f"worker(s); the minimum is {minimum} (conversion.min_{worker.role.value}); "
            "add ?force=true to remove it anyway",
            details={"reason": f"min_{worker.role.value}"},
        )
