"""``GET /get_loads``: every worker's load in one answer, as sglang-router and smg give it.

Their shape is ``{"workers": [{"worker": url, "load": tokens}, ...]}``, the load being the sum of
``num_tokens`` over the DP ranks of the worker's ``/get_load``, and -1 for a worker that did not
answer. pd-router adds each worker's ``worker_type`` (its role), and reads ``/v1/loads`` (the sum
of ``num_total_tokens``, as smg does) from a worker that has no ``/get_load``.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from pd_protocol.json_values import is_int
from pd_router.api.info import json_response
from pd_router.api.keys import REGISTRY, SESSION
from pd_router.control.worker_calls import call
from pd_router.control.workers import Worker

LOAD_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
NO_LOAD = -1


async def handle_get_loads(request: web.Request) -> web.Response:
    session = request.app[SESSION]
    loads = await asyncio.gather(*(worker_load(session, w) for w in request.app[REGISTRY]))
    return json_response({"workers": list(loads)})


async def worker_load(session: aiohttp.ClientSession, worker: Worker) -> dict:
    """One worker's entry: its url, role and load in tokens (-1 when it could not be read)."""
    reply = await call(session, worker, "GET", "/get_load", limit=LOAD_TIMEOUT)
    load = get_load_tokens(reply.body) if reply.ok else NO_LOAD
    if reply.status == 404:
        reply = await call(session, worker, "GET", "/v1/loads", limit=LOAD_TIMEOUT)
        load = v1_loads_tokens(reply.body) if reply.ok else NO_LOAD
    return {"worker": worker.url, "worker_type": worker.role.value, "load": load}


def get_load_tokens(body: bytes) -> int:
    """The tokens a ``/get_load`` answer reports: ``num_tokens`` summed over its DP ranks."""
    return summed(body, None, "num_tokens")


def v1_loads_tokens(body: bytes) -> int:
    """The tokens a ``/v1/loads`` answer reports: ``num_total_tokens`` summed over ``loads``
    (what smg reads)."""
    return summed(body, "loads", "num_total_tokens")


def summed(body: bytes, key: str | None, field: str) -> int:
    """``field`` summed over the entries of ``body`` (a JSON list, or the list under ``key``);
    -1 when the body holds no such number."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return NO_LOAD
    entries = parsed.get(key) if key is not None and isinstance(parsed, dict) else parsed
    if not isinstance(entries, list):
        return NO_LOAD
    values = [e.get(field) for e in entries if isinstance(e, dict)]
    counted = [v for v in values if is_int(v) and v >= 0]
    return sum(counted) if counted else NO_LOAD
