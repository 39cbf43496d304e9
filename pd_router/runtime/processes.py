"""The control process of a multi-process router (``--workers N``, N > 1).

It runs the router's whole application (registry, health probes, circuits, conversions, the
autopilot, etcd membership, the admin and info API) on a Unix socket only the data planes
reach, and N data planes on the shared port (:mod:`pd_router.control.supervisor`), which
route from the snapshots it pushes and report back (:mod:`pd_router.control.publisher`).
``/metrics`` adds every data plane's counters to its own.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
from collections.abc import Sequence

from aiohttp import web

from pd_router.config import RouterConfig
from pd_router.control.supervisor import Supervisor, reuseport_sockets
from pd_router.dataplane.front.listener import backlog_for
from pd_router.dataplane.link.channel import Channel
from pd_router.runtime.app_socket import AppSocket
from pd_router.runtime.router import ROUTER
from pd_router.runtime.signals import begin_stop
from pd_router.shutdown import stop_signalled

log = logging.getLogger("pd_router.processes")

# How a data plane is started: the control process adds its index, sockets and control socket.
DATAPLANE_COMMAND = (sys.executable, "-m", "pd_router.cli.dataplane")


def oversubscription(processes: int, cores: int) -> str | None:
    """The warning for more data planes than cores to run them on, else None: they take turns
    on the cores, and each spends more per request than one process with all the clients."""
    if processes <= cores:
        return None
    return (
        f"{processes} data planes on {cores} usable core{'s' if cores > 1 else ''}: they take "
        f"turns, and serve no more than --workers {cores} would (docs/router.md, 'Choosing N')"
    )


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
    dataplanes = app[ROUTER].dataplanes

    async def attach(index: int, sock: socket.socket) -> None:
        dataplanes.attach(index, await Channel.over(sock))

    app_socket = await AppSocket.start(app)
    try:
        supervisor = Supervisor(
            sockets,
            [*command, "--control-socket", app_socket.path],
            pickle.dumps(config),
            attach=attach,
            detach=dataplanes.detach,
            unresponsive=dataplanes.unresponsive,
        )
        supervisor.start()
        log.info(
            "serving on %s:%d with %d data-plane processes",
            config.host, sockets[0].getsockname()[1], processes,
        )  # fmt: skip
        crowded = oversubscription(processes, len(os.sched_getaffinity(0)))
        if crowded:
            log.warning(crowded)
        try:
            begin_stop(app, await stop_signalled())
        finally:
            await supervisor.stop(config.server.shutdown_grace_secs)
            await dataplanes.stop()
    finally:
        await app_socket.stop()
