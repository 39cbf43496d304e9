"""How every process of the router learns it should stop, and the grace it gives requests in
flight: shared by the control process and the data planes."""

from __future__ import annotations

import asyncio
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# The grace a stopping server gives requests in flight (aiohttp's own default).
SHUTDOWN_GRACE_SECS = 60.0


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
