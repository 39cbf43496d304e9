"""How every process of the router learns it should stop, and what the router does first."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from pd_router.api.state import ROUTER

log = logging.getLogger("pd_router.api.server")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


async def stop_signalled() -> signal.Signals:
    """Return the first SIGINT or SIGTERM this process gets, when it comes."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()

    def received(signum: signal.Signals) -> None:
        if not got.done():
            got.set_result(signum)

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, received, signum)
    return await got


def begin_stop(app: web.Application, signum: signal.Signals) -> None:
    """The router was told to stop: say so, with the grace it gives, and abort the conversions
    still draining at once. Left running, a drain that the shutdown itself ends (its last
    streams finishing) would call the switch on a worker the stopping router then leaves."""
    router = app[ROUTER]
    log.info(
        "%s received: stopping; requests in flight and conversions whose switch call went out "
        "have %gs to finish", signum.name, router.config.server.shutdown_grace_secs,
    )  # fmt: skip
    if router.conversions is not None:
        router.conversions.abort_draining("because the router is shutting down")
