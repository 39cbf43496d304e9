"""How every process of the router learns it should stop."""

from __future__ import annotations

import asyncio
import signal


async def stop_signalled() -> None:
    """Return at the first SIGINT or SIGTERM this process gets."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
