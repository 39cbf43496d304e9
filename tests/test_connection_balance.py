"""Client connections spread evenly over the data planes of one port: the control process tells
the data planes a share while their counts are uneven, and one above it answers a surplus
connection's next request with ``Connection: close``, so the client's new connection is placed
again. Real router processes (``[server] workers = 3``) in front of reference workers; which
process holds a connection is read from ``/proc``."""

from __future__ import annotations

import asyncio
import http.client
import os
import time
from collections import Counter

import orjson

from pd_router.control.publisher import connection_share
from pd_router.dataplane.front.listener import ClientConnections
from tests.conversion_helpers import sample
from tests.router_helpers import generate_body
from tests.router_process import RouterProcess
from tests.test_router_processes import dataplane_pids, paired_sources, three_processes

PILED = 9
# How long the spread may take to even out, and a wait longer than the control process's push
# period, so the data planes have heard that it did.
SETTLE_SECS = 30.0
SHARE_PUSH_SECS = 1.0


class Idle:
    """A connection between requests, as the cap and the share see it."""

    between_requests = True

    def force_close(self) -> None:
        raise AssertionError("not expected to be closed")


def test_no_share_while_the_counts_differ_by_at_most_one():
    assert connection_share([11, 10, 11, 10, 11, 11]) is None
    assert connection_share([64]) is None


def test_the_share_is_the_mean_rounded_up_while_the_counts_are_uneven():
    assert connection_share([9, 0, 0]) == 3
    assert connection_share([16, 12, 8, 12, 10, 6]) == 11


def test_a_data_plane_sheds_no_more_than_its_surplus():
    connections = ClientConnections(limit=100)
    held = [Idle() for _ in range(5)]
    for connection in held:
        connections.admit(connection)
    connections.share = 3
    assert [connections.shed(c) for c in held] == [True, True, False, False, False]
    connections.release(held[0])
    assert not connections.shed(held[2])


def test_a_data_plane_without_a_share_keeps_every_connection():
    connections = ClientConnections(limit=100)
    held = [Idle() for _ in range(5)]
    for connection in held:
        connections.admit(connection)
    assert not any(connections.shed(c) for c in held)


def socket_owners(port: int, pids: set[int]) -> dict[int, int]:
    """The data plane (pid) holding the router's side of each client connection to ``port``,
    by the client's port: /proc/net/tcp gives the socket's inode, the processes' descriptors
    say whose it is."""
    inodes = {}
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].split(":")[1], 16)
            remote_port = int(fields[2].split(":")[1], 16)
            if local_port == port and fields[3] == "01":  # ESTABLISHED
                inodes[fields[9]] = remote_port
    owners = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            inode = target.removeprefix("socket:[").removesuffix("]")
            if inode in inodes:
                owners[inodes[inode]] = pid
    return owners


def accepted(port: int, pids: set[int], client_ports: list[int]) -> dict[int, int]:
    """:func:`socket_owners` of ``client_ports``, once a data plane accepted every one."""
    for _ in range(500):
        owners = socket_owners(port, pids)
        if all(p in owners for p in client_ports):
            return {p: owners[p] for p in client_ports}
        time.sleep(0.01)
    raise AssertionError("connections not accepted within 5 s")


def pile_on_one_process(router: RouterProcess, pids: set[int]) -> list[http.client.HTTPConnection]:
    """Open connections until ``PILED`` of them are held by one data plane, closing those the
    kernel gave to the others: the most uneven spread a client can get."""
    target = min(pids)
    kept: list[http.client.HTTPConnection] = []
    for _ in range(400):
        connection = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
        connection.connect()
        client_port = connection.sock.getsockname()[1]
        if accepted(router.port, pids, [client_port])[client_port] != target:
            connection.close()
            continue
        kept.append(connection)
        if len(kept) == PILED:
            return kept
    raise AssertionError("the kernel never gave one process enough connections")


def spread(router: RouterProcess, pids: set[int], kept: list[http.client.HTTPConnection]):
    """How many of ``kept`` each data plane holds, once every one is open and accepted."""
    for connection in kept:
        if connection.sock is None:
            connection.connect()
    ports = [connection.sock.getsockname()[1] for connection in kept]
    held = Counter({pid: 0 for pid in pids})
    held.update(accepted(router.port, pids, ports).values())
    return held


def ask(connection: http.client.HTTPConnection, prompt: str) -> tuple[int, bool]:
    """One request on ``connection``; its status and whether the router asked to close."""
    body = orjson.dumps(generate_body(prompt, 2))
    connection.request("POST", "/generate", body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    answer.read()
    closing = answer.getheader("connection", "").lower() == "close"
    if closing:
        connection.close()
    return answer.status, closing


def even(held: Counter) -> bool:
    return max(held.values()) - min(held.values()) <= 1


def balance(router: RouterProcess, pids: set[int]) -> tuple[Counter, Counter, list[int], int]:
    """Pile connections on one data plane, then send one request per connection per round (a
    closed connection reopens before the next round) until a round begins evenly spread, and
    then one round more. The first spread, the last, every status, and the connections closed
    in that last round."""
    kept = pile_on_one_process(router, pids)
    first = held = spread(router, pids, kept)
    statuses: list[int] = []
    deadline = time.monotonic() + SETTLE_SECS
    while not even(held) and time.monotonic() < deadline:
        statuses += [ask(c, f"client {i}")[0] for i, c in enumerate(kept)]
        held = spread(router, pids, kept)
    time.sleep(SHARE_PUSH_SECS)
    closed = 0
    for index, connection in enumerate(kept):
        status, closing = ask(connection, f"settled {index}")
        statuses.append(status)
        closed += closing
    last = spread(router, pids, kept)
    for connection in kept:
        connection.close()
    return first, last, statuses, closed


async def test_connections_piled_on_one_data_plane_spread_over_all_of_them(pd_cluster):
    async with three_processes(pd_cluster) as router:
        await paired_sources(router.url, [f"warm {n}" for n in range(30)])
        pids = dataplane_pids(router)
        first, last, statuses, closed = await asyncio.to_thread(balance, router, pids)
        async with router.client() as http:
            moved = await sample(http, "pd_router_client_connections_moved_total")
    assert sorted(first.values()) == [0, 0, PILED]
    assert sorted(last.values()) == [3, 3, 3]
    assert closed == 0  # once even, a connection stays where it is
    assert set(statuses) == {200}
    assert moved >= PILED - 3
