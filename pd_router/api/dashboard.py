"""The router's own status page: ``GET /dashboard`` (one self-contained HTML page) and
``GET /status`` (the JSON it polls).

For operators without Grafana: the page shows the pools (per model when the router serves
several: ``models`` maps each to its pools), each worker's state, role, model, in-flight
count and health (an unhealthy worker listed first in its pool and marked unhealthy before its
state), the recent conversions, the autopilot's mode and last decisions (with their
reasons), and converts a worker through the router's own ``POST /convert_pd_role``. Everything
comes from the registry, the conversion manager and the autopilot, so the page and ``pd-router
status`` show exactly what the router routes on.

With an admin key configured, ``/status`` without the key shows no more than ``/metrics`` does
(pools, and each worker's url, role, model, state, health, circuit and in-flight count): no worker
errors, bootstrap ports, epochs, conversion records or autopilot decisions. The page itself
holds no data and stays open; it asks for the key when an action needs it.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any

import orjson
from aiohttp import web

from pd_router.api.auth import has_admin_key
from pd_router.api.keys import AUTOPILOT, CONFIG, CONVERSIONS, REGISTRY
from pd_router.control.autopilot.controller import Autopilot
from pd_router.control.conversion.manager import Conversion, ConversionManager
from pd_router.control.workers import Role, Worker, WorkerRegistry, WorkerState
from pd_router.roles import PD_ROLES

RECENT_CONVERSIONS = 20
# The worker fields /metrics exposes as well (labels or values): all /status shows without the
# admin key when one is configured.
# ``convert_refused`` too: without it the page, before the key is entered, offered a Convert the
# router refuses (the last prefill); why is built from what the pools already show.
PUBLIC_WORKER_FIELDS = (
    "id", "url", "role", "model", "state", "healthy", "inflight", "circuit", "convert_refused",
)  # fmt: skip

# The page loads nothing from elsewhere; the browser enforces it.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


def add_dashboard_routes(app: web.Application) -> None:
    """Register ``GET /dashboard`` and ``GET /status`` on the router's application."""
    page = (resources.files("pd_router.api") / "static" / "dashboard.html").read_bytes()

    async def dashboard(request: web.Request) -> web.Response:
        return web.Response(
            body=page, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS
        )

    async def status(request: web.Request) -> web.Response:
        app = request.app
        snapshot = status_snapshot(
            app[REGISTRY], app[CONVERSIONS], app[AUTOPILOT], app[CONFIG].admin_api_key
        )
        if not has_admin_key(request):
            snapshot = public_snapshot(snapshot)
        body = orjson.dumps(snapshot)
        return web.Response(
            body=body, content_type="application/json", headers={"Cache-Control": "no-store"}
        )

    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/status", status)


def status_snapshot(
    registry: WorkerRegistry,
    conversions: ConversionManager,
    autopilot: Autopilot,
    admin_api_key: str | None,
) -> dict[str, Any]:
    """Pools, workers and recent conversions as the router sees them right now; serving
    several models, each model's pools too (one model: none, the page as before). Workers
    whose model is not read yet (an unreachable one) make no model of their own, as on the
    request path; with several models they show under ""."""
    models = registry.models()
    several = sum(1 for model in models if model) > 1
    per_model = {"models": models_summary(registry, models)} if several else {}
    return {
        "pools": {role.value: pool_summary(registry, role) for role in registry.roles()},
        **per_model,
        "workers": unhealthy_first([worker_summary(conversions, worker) for worker in registry]),
        "conversions": recent_conversions(conversions),
        "conversions_available": True,
        "autopilot": autopilot_summary(autopilot, name_models=several),
        "admin_key_required": admin_api_key is not None,
        "redacted": False,
        "time": time.time(),
    }


def worker_summary(conversions: ConversionManager, worker: Worker) -> dict[str, Any]:
    """A worker's record and, as ``convert_refused``, why converting it now would be refused
    (None: it would not be; the page shows no Convert button otherwise)."""
    return {**worker.as_dict(), "convert_refused": conversions.refusal(worker)}


def unhealthy_first(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workers failing their probes first, whatever their state: a worker that does not
    answer is what an operator must see, not a green ACTIVE further down (stable: the
    registry's order otherwise)."""
    return sorted(workers, key=lambda worker: bool(worker.get("healthy")))


def public_snapshot(snapshot: dict[str, Any]) -> dict[str, Any]:
    """What a snapshot shows a caller without the admin key: what /metrics shows."""
    return {
        **snapshot,
        "workers": [
            {key: worker[key] for key in PUBLIC_WORKER_FIELDS} for worker in snapshot["workers"]
        ],
        "conversions": [],
        "autopilot": {**snapshot["autopilot"], "last_decision": None, "decisions": []},
        "redacted": True,
    }


def autopilot_summary(autopilot: Autopilot, name_models: bool) -> dict[str, Any]:
    """The autopilot's mode, latest decision and recent conversion decisions (newest first),
    those of every model's pilot; with ``name_models`` (the router serves several models, even
    if one of them in PD) each decision names the ``model`` whose pilot made it."""
    pilots = [
        (pilot.model if name_models else None, pilot.to_json()) for pilot in autopilot.pilots()
    ]
    latest = [
        with_model(state["last_decision"], model)
        for model, state in pilots
        if state["last_decision"]
    ]
    decisions = [with_model(d, model) for model, state in pilots for d in state["decisions"]]
    decisions.sort(key=lambda decision: decision["time"], reverse=True)
    return {
        "mode": autopilot.config.mode,
        "last_decision": max(latest, key=lambda decision: decision["time"], default=None),
        "decisions": decisions[:RECENT_CONVERSIONS],
    }


def with_model(decision: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A decision naming the model whose pilot made it (None: the router serves one)."""
    return decision if model is None else {**decision, "model": model}


def models_summary(registry: WorkerRegistry, models: list[str]) -> dict[str, Any]:
    """Each model's pools: its prefill and decode pools when it is served in PD, its regular
    pool when regular workers serve it (a model may have both)."""
    return {
        model: {
            role.value: pool_summary(registry, role, model) for role in model_roles(registry, model)
        }
        for model in models
    }


def model_roles(registry: WorkerRegistry, model: str) -> tuple[Role, ...]:
    """The pools ``model`` has: prefill and decode if a worker serves it in PD (both, so an
    emptied one shows), regular if a regular worker serves it."""
    pd = PD_ROLES if any(registry.in_role(role, model=model) for role in PD_ROLES) else ()
    regular = (Role.REGULAR,) if registry.in_role(Role.REGULAR, model=model) else ()
    return pd + regular


def pool_summary(registry: WorkerRegistry, role: Role, model: str | None = None) -> dict[str, Any]:
    """Counts and worker ids of ``role``'s pool (of ``model`` when given, of all otherwise)."""
    members = registry.in_role(role, model=model)
    return {
        "active": sum(1 for w in members if w.state is WorkerState.ACTIVE),
        "healthy": registry.active_healthy_count(role, model=model),
        "selectable": len(registry.selectable(role, model)),
        "workers": [w.id for w in members],
    }


def recent_conversions(manager: ConversionManager) -> list[dict[str, Any]]:
    """The newest conversions first."""
    now = time.time()
    return [
        conversion_summary(conversion, now)
        for _, conversion in zip(range(RECENT_CONVERSIONS), manager.history(), strict=False)
    ]


def started_by(conversion: Conversion) -> str:
    """Who started a conversion, and through which replica when there are several."""
    by = conversion.request.started_by
    return f"{by} on {conversion.replica}" if conversion.replica else by


def conversion_summary(conversion: Conversion, now: float) -> dict[str, Any]:
    """One row of the page's table (the full record is at ``GET /conversions/{id}``)."""
    ended = conversion.finished_at if conversion.finished_at is not None else now
    return {
        "id": conversion.id,
        "worker": conversion.worker.url,
        "worker_id": conversion.worker.id,
        "from_role": conversion.from_role.value,
        "to_role": conversion.to_role.value,
        "status": conversion.status.value,
        "finished": conversion.finished,
        "success": conversion.succeeded,
        "message": conversion.message,
        "started_at": conversion.created_at,
        "started_by": started_by(conversion),
        "duration_s": round(ended - conversion.created_at, 4),
    }
