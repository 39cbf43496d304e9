"""What the router does first when it is told to stop."""

from __future__ import annotations

import logging
import signal

from aiohttp import web

from pd_router.runtime.router import ROUTER

log = logging.getLogger("pd_router.runtime")


def begin_stop(app: web.Application, signum: signal.Signals) -> None:
    """The router was told to stop: say so, with the grace it gives, and abort the conversions
    still draining at once. Left running, a drain that the shutdown itself ends (its last
    streams finishing) would call the switch on a worker the stopping router then leaves."""
    router = app[ROUTER]
    log.info(
        "%s received: stopping; requests in flight and conversions whose switch call went out "
        "have %gs to finish", signum.name, router.config.server.shutdown_grace_secs,
    )  # fmt: skip
    router.conversions.abort_draining("because the router is shutting down")
