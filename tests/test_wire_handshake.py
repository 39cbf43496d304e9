"""The wire's handshake and snapshot check across the control/data-plane boundary: a data-plane
process that meets a control side of another protocol version exits with one line naming both;
the control side refuses a data plane of another version and closes its channel; a socket
channel that receives a malformed message is closed; a data plane that finds a snapshot
inconsistent routes on from the last one, and the control side logs it."""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import subprocess
import sys

import pytest

from pd_router.config import HealthConfig, load_config
from pd_router.control.circuit import CircuitConfig
from pd_router.control.health import HealthMonitor
from pd_router.control.latency import Latencies
from pd_router.control.publisher import DataPlanes
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.dataplane.link.channel import HEADER, Channel
from pd_router.metrics import RouterMetrics
from pd_router.wire import PROTOCOL_VERSION, ChannelClosed, Hello, Message, Snapshot, decode, encode
from tests.router_helpers import generate_body, running_router, wait_until


async def forget_nothing(decode: Worker, prefill: Worker) -> None:
    """The publisher's ``forget``, for tests where no pair gets stuck."""


OTHER_VERSION = PROTOCOL_VERSION + 1


def read_message(sock: socket.socket) -> Message:
    """One framed message read from a blocking socket."""
    (size,) = HEADER.unpack(read_exactly(sock, HEADER.size))
    return decode(read_exactly(sock, size))


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, "the data plane closed its channel"
        data += chunk
    return data


def test_a_data_plane_process_meeting_another_protocol_version_exits_with_one_line(tmp_path):
    config = tmp_path / "config.pickle"
    config.write_bytes(pickle.dumps(load_config(None, {})))
    listen = socket.create_server(("127.0.0.1", 0))
    control, plane = socket.socketpair()
    with listen, control, plane, config.open("rb") as stdin:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "pd_router.cli.dataplane", "--index", "0",
                "--listen-fd", str(listen.fileno()), "--channel-fd", str(plane.fileno()),
                "--control-socket", str(tmp_path / "control.sock"),
            ],
            stdin=stdin,
            stderr=subprocess.PIPE,
            pass_fds=(listen.fileno(), plane.fileno()),
        )  # fmt: skip
        try:
            control.settimeout(20.0)
            assert read_message(control) == Hello(PROTOCOL_VERSION)
            data = encode(Hello(OTHER_VERSION))
            control.sendall(HEADER.pack(len(data)) + data)
            _, stderr = proc.communicate(timeout=20.0)
        finally:
            proc.kill()
            proc.wait()
    lines = stderr.decode().strip().splitlines()
    assert proc.returncode == 2
    assert len(lines) == 1, lines
    assert (
        f"data plane 0 speaks protocol version {PROTOCOL_VERSION}, "
        f"the control process {OTHER_VERSION}; exiting"
    ) in lines[0]


async def test_a_socket_channel_that_receives_a_malformed_message_is_closed():
    near, far = socket.socketpair()
    channel = await Channel.over(near)
    far.sendall(HEADER.pack(9) + b'["nope",]')
    try:
        with pytest.raises(ChannelClosed, match="not JSON"):
            await asyncio.wait_for(channel.receive(), 5.0)
    finally:
        channel.close()
        far.close()


async def test_the_control_side_refuses_a_data_plane_of_another_version_and_closes_it(caplog):
    registry = WorkerRegistry(RouterMetrics(), CircuitConfig())
    dataplanes = DataPlanes(
        registry, HealthMonitor(registry, HealthConfig()), Latencies(), forget_nothing
    )
    control_end, plane_end = socket.socketpair()
    dataplanes.attach(0, await Channel.over(control_end))
    plane = await Channel.over(plane_end)
    try:
        plane.send(Hello(OTHER_VERSION))
        received = []
        with pytest.raises(ChannelClosed):
            while True:
                received.append(await asyncio.wait_for(plane.receive(), 5.0))
    finally:
        plane.close()
        await dataplanes.stop()
    assert received[:2] == [Hello(PROTOCOL_VERSION), Snapshot(0, ())]
    assert (
        f"data plane 0 speaks protocol version {OTHER_VERSION}, "
        f"this control process {PROTOCOL_VERSION}: refused"
    ) in caplog.text


async def test_an_inconsistent_snapshot_is_not_applied_and_the_control_side_logs_it(
    pd_cluster, caplog
):
    caplog.set_level(logging.ERROR)
    async with running_router(pd_cluster) as router, router.client() as http:
        pools = router.dataplane.pools
        routing = pools.version
        # An empty snapshot that does not follow the one routed from: applied, it would leave
        # no worker to route to.
        router.dataplane.take(Snapshot(routing, ()))
        await wait_until(
            lambda: f"refused snapshot {routing}" in caplog.text, 5.0, "the refusal logged"
        )
        response = await http.post("/generate", json=generate_body("still routed"))
    assert response.status_code == 200
    assert pools.version >= routing
    assert f"snapshot {routing} not applied (version {routing} does not follow" in caplog.text
