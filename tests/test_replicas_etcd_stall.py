"""etcd stalling (SIGSTOP) for longer than the leases under router replicas: when it answers
again it expires every lease it holds, so the records of self-registered workers go and come
back a moment later. A worker that serves stays in every replica's pool through that churn."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

from tests.conftest import ClusterFactory
from tests.conversion_helpers import wait_for_busy
from tests.etcd_helpers import EtcdServer
from tests.replica_helpers import (
    LEASE_TTL_SECS,
    failures,
    load_on_all,
    more_requests,
    replicas,
    workers_of,
)
from tests.router_helpers import generate_body, wait_until
from tests.router_process import RouterProcess

CLUSTER = "test"  # the name tests/replica_helpers.py gives the replicas' cluster
# Longer than every lease (the workers' and the replicas'), so etcd expires them on waking.
STALL_SECS = 2 * LEASE_TTL_SECS + 1
# The behaviour under test: back everywhere this soon after etcd answers again.
BACK_WITHIN_SECS = 2.0
# How long a worker must stay listed once it is back.
STAYS_SECS = 2 * LEASE_TTL_SECS
# Generations that outlast the stall: 1200 tokens at this speed take about 12 s.
LONG_SPEED = 0.6
LONG = generate_body("a long generation", 1200)


def _self_registered(factory: ClusterFactory, etcd: EtcdServer, **counts: int) -> list[str]:
    workers = factory(
        **counts, speed=0.05, etcd=etcd.url, cluster_name=CLUSTER, etcd_lease_ttl=LEASE_TTL_SECS
    )
    return workers.urls


async def _stall(etcd: EtcdServer) -> float:
    """Freeze etcd for STALL_SECS; the monotonic time it answers again."""
    with etcd.stalled():
        await asyncio.sleep(STALL_SECS)
    await wait_until(lambda: asyncio.to_thread(etcd.healthy), 10.0, "etcd answers again")
    return time.monotonic()


@contextlib.asynccontextmanager
async def _tasks() -> AsyncIterator[list[asyncio.Task[httpx.Response]]]:
    """Requests a test starts; cancelled if the test ends before they do."""
    started: list[asyncio.Task[httpx.Response]] = []
    try:
        yield started
    finally:
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)


async def _all_listed(routers: list[RouterProcess], roles: dict[str, str]) -> bool:
    """Whether every replica lists every worker ACTIVE and healthy in its role."""
    wanted = {url: (role, "active", True) for url, role in roles.items()}
    for router in routers:
        states = await _states(router)
        if {url: states.get(url) for url in wanted} != wanted:
            return False
    return True


async def _states(router: RouterProcess) -> dict[str, tuple[str, str, bool]]:
    return {
        u: (w["role"], w["state"], w["healthy"]) for u, w in (await workers_of(router.url)).items()
    }


async def _back_everywhere(
    routers: list[RouterProcess], roles: dict[str, str], answered_at: float
) -> None:
    deadline = answered_at + BACK_WITHIN_SECS
    while not await _all_listed(routers, roles):
        if time.monotonic() > deadline:
            seen = {r.url: await _states(r) for r in routers}
            raise AssertionError(f"not back everywhere {BACK_WITHIN_SECS}s after etcd: {seen}")
        await asyncio.sleep(0.05)


async def test_an_etcd_stall_longer_than_the_leases_fails_no_request_and_keeps_every_worker(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    """The only prefill registered itself: losing it for a moment would fail every request."""
    configured = cluster_factory(prefill=0, decode=1, speed=0.05)
    registered = _self_registered(cluster_factory, etcd_server, prefill=1, decode=1)
    roles = dict.fromkeys(configured.decode_urls, "decode")
    roles.update(zip(registered, ("prefill", "decode"), strict=True))
    async with replicas(configured, etcd_server, 3) as routers:
        await wait_until(lambda: _all_listed(routers, roles), 10.0, "every worker everywhere")
        async with load_on_all(routers, 12) as loads:
            await more_requests(loads, 10)
            answered_at = await _stall(etcd_server)
            await _back_everywhere(routers, roles, answered_at)
            await asyncio.sleep(LEASE_TTL_SECS)
            await more_requests(loads, 10)
        assert failures(loads) == []
        assert await _all_listed(routers, roles)


async def test_a_worker_whose_record_is_put_again_under_long_requests_stays_on_every_replica(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    configured = cluster_factory(prefill=1, decode=0, speed=0.05)
    (decode,) = cluster_factory(
        prefill=0,
        decode=1,
        speed=LONG_SPEED,
        etcd=etcd_server.url,
        cluster_name=CLUSTER,
        etcd_lease_ttl=LEASE_TTL_SECS,
    ).urls
    roles = {configured.prefill_urls[0]: "prefill", decode: "decode"}
    async with replicas(configured, etcd_server, 2) as routers:
        await wait_until(lambda: _all_listed(routers, roles), 10.0, "every worker everywhere")
        async with httpx.AsyncClient(timeout=120.0) as http, _tasks() as long:
            long += [
                asyncio.create_task(http.post(router.url + "/generate", json=LONG))
                for router in routers
                for _ in range(3)
            ]
            await wait_for_busy([decode])
            answered_at = await _stall(etcd_server)
            await _back_everywhere(routers, roles, answered_at)
            replies = await asyncio.gather(*long)
        assert [r.status_code for r in replies] == [200] * len(replies)
        deadline = time.monotonic() + STAYS_SECS
        while time.monotonic() < deadline:
            assert await _all_listed(routers, roles), {r.url: await _states(r) for r in routers}
            await asyncio.sleep(0.1)
