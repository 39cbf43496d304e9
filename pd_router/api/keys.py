"""The collaborators the handlers reach through their application, one key each.

The composition root (:mod:`pd_router.runtime.router`) builds them and stores each under its key;
a handler reads only the ones it needs, never a whole router.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from pd_router.config import RouterConfig
from pd_router.control.autopilot.controller import Autopilot
from pd_router.control.cluster.local import Cluster
from pd_router.control.conversion.manager import ConversionManager
from pd_router.control.health import HealthMonitor
from pd_router.control.publisher import DataPlanes
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.metrics import RouterMetrics

CONFIG = web.AppKey("config", RouterConfig)
METRICS = web.AppKey("metrics", RouterMetrics)
REGISTRY = web.AppKey("registry", WorkerRegistry)
HEALTH = web.AppKey("health", HealthMonitor)
CLUSTER = web.AppKey("cluster", Cluster)
CONVERSIONS = web.AppKey("conversions", ConversionManager)
AUTOPILOT = web.AppKey("autopilot", Autopilot)
DATAPLANES = web.AppKey("dataplanes", DataPlanes)
# The shared client session the router calls its workers on (fan-outs, loads, info).
SESSION = web.AppKey("session", aiohttp.ClientSession)
# Removes a REMOVING worker once its requests end; answers whether the wait timed out. The
# removal goes on if the caller goes away.
REMOVE_WORKER: web.AppKey[Callable[[Worker], Awaitable[bool]]] = web.AppKey("remove_worker")
