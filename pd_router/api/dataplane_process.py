"""One data plane of a multi-process router (``--workers N``), started by the control process
(:mod:`pd_router.api.processes`) with its listening socket and its channel.

It serves the generation endpoints from the pools the control process pushes (it waits for the
first snapshot before it accepts a connection) and reports back (:mod:`pd_router.dataplane.
reports`); every other path is relayed to the control process's application
(:mod:`pd_router.dataplane.front.relay`).

It stops on SIGTERM or SIGINT (exit status 0) and when the control process goes away (exit
status 1): it stops accepting and lets the requests in flight finish, up to the shutdown
deadline. Without the control process nothing probes the workers, decides their circuits or
honours a conversion any more, so routing on from the last snapshot could send traffic to a
worker another router is switching; the orchestrator restarts the whole router instead. A
control process that hangs (stopped, or its event loop blocked) goes away too: one that sent
nothing for :data:`CONTROL_SILENCE_SECS` (it sends every second) is killed, since it holds every
listening socket and would keep taking connections that nobody answers once its data planes
left.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Coroutine
from typing import Any

import aiohttp

from pd_router.api.app_socket import SHUTDOWN_GRACE_SECS
from pd_router.api.server import client_limits, front_server
from pd_router.api.signals import stop_signalled
from pd_router.config import RouterConfig
from pd_router.dataplane.admission import BodyAdmission
from pd_router.dataplane.channel import Channel, ChannelClosed
from pd_router.dataplane.concurrency import RequestAdmission
from pd_router.dataplane.front.relay import Relay
from pd_router.dataplane.http1_conn import WorkerUnavailable
from pd_router.dataplane.legs import leg_setup
from pd_router.dataplane.listener import ClientConnections
from pd_router.dataplane.path import RequestMetrics, RequestPath
from pd_router.dataplane.policies import make_policy
from pd_router.dataplane.reports import Reports
from pd_router.dataplane.snapshot import SnapshotPools
from pd_router.dataplane.upstream import abort
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from pd_router.tls import server_context

log = logging.getLogger("pd_router.dataplane")

FIRST_SNAPSHOT_TIMEOUT_SECS = 30.0
CONTROL_SILENCE_SECS = 10.0


class Background:
    """Fire-and-forget tasks (aborts), kept until they end."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def serve_dataplane(
    config: RouterConfig,
    index: int,
    listen: socket.socket,
    channel_socket: socket.socket,
    control_socket: str,
) -> int:
    """Serve until told to stop (0) or until the control process is gone (1)."""
    channel = await Channel.over(channel_socket)
    metrics = RouterMetrics()
    request_metrics = RequestMetrics(metrics)
    connections = ClientConnections(
        client_limits(config).max_connections, metrics.client_connections_moved_total.inc
    )
    reports = Reports(channel, metrics, connections)
    setup = leg_setup(config, request_metrics.count_upstream_error)
    pool = setup.pool
    pools = SnapshotPools(
        {
            role: make_policy(config.policy_of(role), config.cache_aware, shared=True)
            for role in Role
        },
        index=index,
        wake=reports.wake,
        suspect=reports.suspect,
        count_refusal=reports.count_refusal,
        on_unavailable=lambda url: pool.abort_target(
            url, WorkerUnavailable(f"worker {url} left service")
        ),
    )
    # For aborts only: the legs have their own pool.
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=setup.worker_ssl or True),
        headers=setup.worker_headers,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )
    background = Background()
    path = RequestPath(
        pools=pools,
        legs=setup.legs,
        leg_headers=setup.leg_headers,
        retry=config.retry,
        admission=RequestAdmission(config.admission.shared_by(config.server.processes), metrics),
        latency=reports,
        metrics=request_metrics,
        abort=lambda worker, rids: background.spawn(abort(session, worker, rids)),
    )
    relay = Relay(control_socket)
    await relay.start()
    admission = BodyAdmission(config.max_payload_size, config.max_inflight_body_bytes)
    tls = server_context(config.tls)
    front = front_server(config, path, relay, admission, tls, connections)
    try:
        first = await asyncio.wait_for(channel.receive(), FIRST_SNAPSHOT_TIMEOUT_SECS)
        take(first, pools, reports, connections)
        await front.start(sock=listen)
    except (ChannelClosed, TimeoutError):
        log.error("data plane %d: no snapshot from the control process; exiting", index)
        await relay.stop()
        await session.close()
        return 1
    loop = asyncio.get_running_loop()
    follow = loop.create_task(follow_control(channel, pools, reports, connections))
    reporting = loop.create_task(reports.run(pools))
    stopped = loop.create_task(stop_signalled())
    await asyncio.wait((follow, stopped), return_when=asyncio.FIRST_COMPLETED)
    control_gone = follow.done()
    if control_gone:
        log.error("data plane %d: the control process is gone; stopping", index)
    await front.stop(SHUTDOWN_GRACE_SECS)
    for task in (follow, reporting, stopped):
        task.cancel()
    reports.send(pools)
    channel.close()
    await relay.stop()
    await session.close()
    pool.close()
    return 1 if control_gone else 0


def take(
    message: dict[str, Any],
    pools: SnapshotPools,
    reports: Reports,
    connections: ClientConnections,
) -> None:
    """Apply one message of the control process."""
    kind = message.get("t")
    if kind == "snapshot":
        pools.apply(message["v"], message["workers"])
        reports.send(pools, force=True)
    elif kind == "inflight":
        pools.apply_inflight(message["totals"])
        connections.share = message["share"]
    elif kind == "metrics?":
        reports.send_metrics(message["n"])


async def follow_control(
    channel: Channel, pools: SnapshotPools, reports: Reports, connections: ClientConnections
) -> None:
    """Apply what the control process sends until its channel closes, or until it has been
    silent for :data:`CONTROL_SILENCE_SECS`: then it is hung, and killed."""
    control = os.getppid()
    while True:
        try:
            message = await asyncio.wait_for(channel.receive(), CONTROL_SILENCE_SECS)
        except ChannelClosed:
            return
        except TimeoutError:
            kill_hung_control(control)
            return
        take(message, pools, reports, connections)


def kill_hung_control(pid: int) -> None:
    """Kill the control process ``pid``, unless this process has outlived it already."""
    if os.getppid() != pid:
        return
    log.error(
        "the control process (pid %d) sent nothing for %.0f s; killing it", pid,
        CONTROL_SILENCE_SECS,
    )  # fmt: skip
    os.kill(pid, signal.SIGKILL)
