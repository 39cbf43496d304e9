"""The legs' side of the router built from its configuration, the same in one process and in
every data plane: the keep-alive pool to the workers, its limits and error metric, the headers
of every call to a worker and those of each role's legs."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from pd_protocol.wire import ROLE_HEADER
from pd_router.config import RouterConfig
from pd_router.dataplane.legs.leg import ErrorCounter, Legs
from pd_router.dataplane.legs.pool import Http1Pool
from pd_router.roles import Role
from pd_router.tls import worker_context


@dataclass(slots=True)
class LegSetup:
    pool: Http1Pool
    legs: Legs
    # Sent on every call to a worker (legs, probes, fan-outs, aborts, control).
    worker_headers: dict[str, str]
    # The headers of each role's legs but the request id. A leg names the role it is routed
    # as: an extension worker that serves the other role answers 421 at once instead of
    # failing the KV hand-off minutes later.
    leg_headers: dict[Role, dict[str, str]]
    # Every connection to an https:// worker verifies it with this context; None: the
    # defaults (system CAs, no client certificate).
    worker_ssl: ssl.SSLContext | None


def leg_setup(config: RouterConfig, count_error: ErrorCounter) -> LegSetup:
    worker_ssl = worker_context(config.tls) if config.tls.configures_workers else None
    pool = Http1Pool(
        connect_timeout=config.connect_timeout_secs,
        request_timeout=config.request_timeout_secs,
        ssl_context=worker_ssl,
    )
    worker_headers = (
        {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
    )
    leg_headers = {
        role: {"Content-Type": "application/json", **worker_headers, ROLE_HEADER: role.value}
        for role in Role
    }
    return LegSetup(
        pool, Legs(pool, config.legs, count_error), worker_headers, leg_headers, worker_ssl
    )
