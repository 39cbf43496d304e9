"""The router's aiohttp application served on a Unix socket of its own, where the client side
(:mod:`pd_router.dataplane.front`) of this process, or of every data plane, relays what it does
not serve itself."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

from aiohttp import web

from pd_router.shutdown import SHUTDOWN_GRACE_SECS


@dataclass
class AppSocket:
    """The router application served on a Unix socket of its own (in a private folder)."""

    runner: web.AppRunner
    folder: str

    @property
    def path(self) -> str:
        return os.path.join(self.folder, "app.sock")

    @classmethod
    async def start(cls, app: web.Application) -> AppSocket:
        """Serve ``app`` (its start-up hooks run here), the socket readable by this user only."""
        runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_SECS
        )
        await runner.setup()
        served = cls(runner, tempfile.mkdtemp(prefix="pd-router-"))
        try:
            await web.UnixSite(runner, served.path).start()
        except BaseException:
            await served.stop()
            raise
        os.chmod(served.path, 0o600)
        return served

    async def stop(self) -> None:
        await self.runner.cleanup()
        shutil.rmtree(self.folder, ignore_errors=True)
