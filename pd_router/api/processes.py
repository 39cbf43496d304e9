"""The control process of a multi-process router (``--workers N``, N > 1).

It runs the router's whole application (registry, health probes, circuits, conversions, the
autopilot, etcd membership, the admin and info API) on a Unix socket only the data planes
reach, and N data planes on the shared port (:mod:`pd_router.control.supervisor`), which
route from the snapshots it pushes and report back (:mod:`pd_router.control.dataplanes`).
``/metrics`` adds every data plane's counters to its own.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Sequence

from aiohttp import web

from pd_router.api.info import DATAPLANES
from pd_router.api.signals import stop_signalled
from pd_router.api.state import ROUTER
from pd_router.config import RouterConfig
from pd_router.control.dataplanes import DataPlanes
from pd_router.control.supervisor import Supervisor, reuseport_sockets
from pd_router.dataplane.channel import Channel
from pd_router.dataplane.listener import backlog_for

log = logging.getLogger("pd_router.processes")

# How a data plane is started: the control process adds its index, sockets and control socket.
DATAPLANE_COMMAND = (sys.executable, "-m", "pd_router.cli.dataplane")
# A data plane's own shutdown deadline for its requests in flight, plus what it may need to
# close its connections.
SHUTDOWN_GRACE_SECS = 60.0


async def serve_processes(
    config: RouterConfig,
    app: web.Application,
    processes: int,
    max_connections: int,
    command: Sequence[str] = DATAPLANE_COMMAND,
) -> None:
    """Serve ``app`` (the router's application) in this process, the control process, and
    ``processes`` data planes on the shared port until SIGINT or SIGTERM; then every data
    plane stops accepting and finishes its requests in flight."""
    sockets = reuseport_sockets(config.host, config.port, processes, backlog_for(max_connections))
    router = app[ROUTER]
    dataplanes = DataPlanes(router.registry, router.health, router.latency)
    app[DATAPLANES] = dataplanes
    with tempfile.TemporaryDirectory(prefix="pd-router-") as folder:
        control_socket = os.path.join(folder, "control.sock")
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.UnixSite(runner, control_socket)
        await site.start()
        os.chmod(control_socket, 0o600)

        async def attach(index: int, sock: socket.socket) -> None:
            dataplanes.attach(index, await Channel.over(sock))

        supervisor = Supervisor(
            sockets,
            [*command, "--control-socket", control_socket],
            pickle.dumps(config),
            attach=attach,
            detach=dataplanes.detach,
        )
        supervisor.start()
        log.info(
            "serving on %s:%d with %d data-plane processes",
            config.host, sockets[0].getsockname()[1], processes,
        )  # fmt: skip
        try:
            await stop_signalled()
        finally:
            await supervisor.stop(SHUTDOWN_GRACE_SECS)
            await dataplanes.stop()
            await runner.cleanup()
