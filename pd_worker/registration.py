"""``pd-worker serve --etcd ...``: the worker's record in etcd for as long as it serves.

The record is put once the HTTP listener serves (a router that sees it can reach the worker)
and its lease is revoked on a graceful shutdown. The role and bootstrap port it reports are
the engine's live ones, so a record written again after an in-process role switch carries the
new role (a regular server's, ``null``, is put as ``regular``). ``/metrics`` says meanwhile
whether the registration holds and how long the worker went without one
(:class:`pd_worker.metrics.RegistrationCollector`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
from prometheus_client import CollectorRegistry

from pd_protocol.registration import RegistrationSettings, advertise_url
from pd_worker.engine import Engine
from pd_worker.metrics import RegistrationCollector


@contextlib.asynccontextmanager
async def registered(
    engine: Engine, settings: RegistrationSettings | None, metrics: CollectorRegistry
) -> AsyncIterator[None]:
    """Keep the worker registered inside the block, its state exported through ``metrics``
    (nothing happens without settings)."""
    if settings is None:
        yield
        return
    config = engine.config
    scheme = "https" if config.ssl_certfile is not None else "http"
    own_url = advertise_url(scheme, config.host, config.port)
    async with aiohttp.ClientSession() as session:
        registration = settings.registration(
            session, own_url, lambda: (engine.role_name, engine.bootstrap_port)
        )
        collector = RegistrationCollector(registration.stats)
        metrics.register(collector)
        await registration.start()
        try:
            yield
        finally:
            await registration.stop()
            metrics.unregister(collector)
