"""The decode's pooled bootstrap connections against a real bootstrap server on loopback.

A decode keeps idle connections per prefill, so consecutive pulls must reuse one connection,
survive the prefill dropping it (reconnect once), still time out against a hung prefill, and
release everything when the decode role is torn down.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import orjson
import pytest

from pd_worker.bootstrap import BootstrapServer, Room, RoomRegistry
from pd_worker.cluster import LOOPBACK, free_port
from pd_worker.errors import KVTransferError
from pd_worker.kv_pull import KVPuller
from pd_worker.testing import poll_until

SOURCE = "http://prefill.test"
TIMEOUT_SECS = 5.0


@dataclass
class Prefill:
    """A bootstrap server with its rooms, and the hang fault switch."""

    port: int
    rooms: RoomRegistry = field(default_factory=RoomRegistry)
    hung: bool = False
    server: BootstrapServer | None = None

    async def start(self) -> None:
        self.server = BootstrapServer(
            LOOPBACK,
            self.rooms,
            SOURCE,
            room_wait_secs=TIMEOUT_SECS,
            before_send=_no_transfer_delay,
            is_hung=lambda: self.hung,
        )
        await self.server.start(self.port)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def publish(self, room_id: int, payload: bytes) -> None:
        self.rooms.open(room_id, len(payload)).payload.set_result(payload)


async def _no_transfer_delay(room: Room) -> None:
    """Speed 0: the modeled transfer takes no time."""


@pytest.fixture
async def prefill() -> AsyncIterator[Prefill]:
    server = Prefill(free_port())
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def puller() -> AsyncIterator[KVPuller]:
    kv_puller = KVPuller()
    yield kv_puller
    kv_puller.close()


async def test_consecutive_pulls_reuse_one_connection(prefill: Prefill, puller: KVPuller):
    for room_id, payload in ((1, b"first"), (2, b"second")):
        prefill.publish(room_id, payload)
        pulled = await puller.pull(LOOPBACK, prefill.port, room_id, TIMEOUT_SECS)
        assert (pulled.payload, pulled.source) == (payload, SOURCE)
    assert prefill.server is not None and prefill.server.num_connections == 1


async def test_an_error_reply_keeps_the_connection_usable(prefill: Prefill, puller: KVPuller):
    prefill.rooms.open(1, 2).payload.cancel()
    with pytest.raises(KVTransferError, match="was freed"):
        await puller.pull(LOOPBACK, prefill.port, 1, TIMEOUT_SECS)
    prefill.publish(2, b"after the error")
    pulled = await puller.pull(LOOPBACK, prefill.port, 2, TIMEOUT_SECS)
    assert pulled.payload == b"after the error"
    assert prefill.server is not None and prefill.server.num_connections == 1


async def test_a_pooled_connection_dropped_by_a_restarted_prefill_is_replaced(
    prefill: Prefill, puller: KVPuller
):
    prefill.publish(1, b"before restart")
    await puller.pull(LOOPBACK, prefill.port, 1, TIMEOUT_SECS)
    await prefill.stop()
    await prefill.start()
    prefill.publish(2, b"after restart")
    pulled = await puller.pull(LOOPBACK, prefill.port, 2, TIMEOUT_SECS)
    assert pulled.payload == b"after restart"


async def test_a_hung_prefill_times_out_a_pull_on_a_pooled_connection(
    prefill: Prefill, puller: KVPuller
):
    prefill.publish(1, b"kv")
    await puller.pull(LOOPBACK, prefill.port, 1, TIMEOUT_SECS)
    prefill.hung = True
    prefill.publish(2, b"never sent")
    with pytest.raises(KVTransferError, match=r"KVPoll\.WaitingForInput"):
        await puller.pull(LOOPBACK, prefill.port, 2, 0.2)


async def test_closing_the_puller_closes_its_idle_connections(prefill: Prefill):
    kv_puller = KVPuller()
    prefill.publish(1, b"kv")
    await kv_puller.pull(LOOPBACK, prefill.port, 1, TIMEOUT_SECS)
    kv_puller.close()
    server = prefill.server
    assert server is not None

    async def no_connections() -> bool:
        return server.num_connections == 0

    await poll_until(no_connections, "the prefill sees the pooled connection closed")


async def test_a_pooled_connection_closed_without_an_answer_is_retried_once_on_a_new_one(
    puller: KVPuller,
):
    accepted: list[int] = []

    async def flaky_prefill(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answers every request, except that its first connection dies on the second one."""
        accepted.append(len(accepted))
        first_connection = len(accepted) == 1
        served = 0
        while await reader.readline():
            if first_connection and served == 1:
                break
            payload = b"kv %d" % served
            header = {"ok": True, "nbytes": len(payload), "source": SOURCE}
            writer.write(orjson.dumps(header) + b"\n" + payload)
            await writer.drain()
            served += 1
        writer.close()

    port = free_port()
    server = await asyncio.start_server(flaky_prefill, LOOPBACK, port)
    async with server:
        first = await puller.pull(LOOPBACK, port, 1, TIMEOUT_SECS)
        second = await puller.pull(LOOPBACK, port, 2, TIMEOUT_SECS)
    assert (first.payload, second.payload) == (b"kv 0", b"kv 0")
    assert accepted == [0, 1]
