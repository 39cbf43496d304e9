"""Router replicas for the cluster tests: several router processes on one etcd, in front of one
set of reference workers, named ``r1``, ``r2``... and ready once each sees all the others."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pd_worker.cluster import WorkerCluster
from tests.conversion_helpers import CheckedLoad
from tests.etcd_helpers import EtcdServer
from tests.router_helpers import wait_until
from tests.router_process import RouterProcess, router_process

# Short, so a dead replica's claims go within the tests' patience; at least 2 s, so a loaded
# CI machine does not miss a keepalive.
LEASE_TTL_SECS = 2


def cluster_config(etcd: EtcdServer, replica_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "etcd": [etcd.url],
        "name": "test",
        "lease_ttl_secs": LEASE_TTL_SECS,
        "replica_id": replica_id,
        **extra,
    }


async def cluster_view(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return (await http.get(url + "/cluster")).json()


async def workers_of(url: str) -> dict[str, dict[str, Any]]:
    """{worker url: its entry in the replica's ``GET /workers``}."""
    async with httpx.AsyncClient(timeout=5.0) as http:
        listing = (await http.get(url + "/workers")).json()["workers"]
    return {w["url"]: w for w in listing}


@contextlib.asynccontextmanager
async def replicas(
    workers: WorkerCluster, etcd: EtcdServer, count: int, **overrides: Any
) -> AsyncIterator[list[RouterProcess]]:
    """``count`` router replicas over ``workers`` (each configured with all of them), ready
    when every one lists every replica."""
    prefill = [(url, workers.bootstrap_port(url)) for url in workers.prefill_urls]
    async with contextlib.AsyncExitStack() as stack:
        routers = [
            await stack.enter_async_context(
                router_process(
                    prefill=prefill,
                    decode=workers.decode_urls,
                    cluster=cluster_config(etcd, f"r{i + 1}"),
                    log_format="text",
                    **overrides,
                )
            )
            for i in range(count)
        ]
        names = [f"r{i + 1}" for i in range(count)]

        async def all_joined() -> bool:
            for router in routers:
                if (await cluster_view(router.url)).get("replicas") != names:
                    return False
            return True

        await wait_until(all_joined, 10.0, "every replica sees the others")
        yield routers


async def roles_agree(routers: list[RouterProcess], url: str, role: str) -> bool:
    """Whether every replica has ``url`` ACTIVE as ``role``."""
    for router in routers:
        entry = (await workers_of(router.url)).get(url)
        if entry is None or (entry["role"], entry["state"]) != (role, "active"):
            return False
    return True


@contextlib.asynccontextmanager
async def load_on_all(
    routers: list[RouterProcess], clients: int
) -> AsyncIterator[list[CheckedLoad]]:
    """``clients`` checked clients spread evenly over the replicas, one load per replica."""
    shares = [clients // len(routers) + (i < clients % len(routers)) for i in range(len(routers))]
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(CheckedLoad(router.url, concurrency=share))
            for router, share in zip(routers, shares, strict=True)
        ]


async def more_requests(loads: list[CheckedLoad], count: int) -> None:
    """Until every load has answered ``count`` more requests."""
    for load in loads:
        await load.wait_for_requests(load.result.ok + load.result.failed + count)


def failures(loads: list[CheckedLoad]) -> list[str]:
    return [error for load in loads for error in load.result.errors]
