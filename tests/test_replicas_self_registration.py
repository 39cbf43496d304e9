"""Workers that register themselves (``pd-worker serve --etcd``) in front of router replicas
agreeing through a real etcd: they join every replica's pool, and leave it when they die."""

from __future__ import annotations

import aiohttp
import httpx

from pd_protocol.cluster import ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import EtcdClient
from pd_worker.cluster import WorkerCluster
from tests.conftest import ClusterFactory
from tests.etcd_helpers import EtcdServer
from tests.replica_helpers import LEASE_TTL_SECS, replicas, workers_of
from tests.router_helpers import wait_until
from tests.router_process import RouterProcess

CLUSTER = "test"  # the name tests/replica_helpers.py gives the replicas' cluster
# A killed worker's lease expires after its TTL; then every replica's watch sees the deletion.
# The margin covers a busy 2-core machine.
EXPIRY_MARGIN_S = 4.0


def _self_registered(factory: ClusterFactory, etcd: EtcdServer) -> WorkerCluster:
    return factory(
        prefill=0,
        decode=1,
        speed=0.0,
        etcd=etcd.url,
        cluster_name=CLUSTER,
        etcd_lease_ttl=LEASE_TTL_SECS,
    )


async def _listed_by_all(routers: list[RouterProcess], url: str, listed: bool) -> bool:
    for router in routers:
        if (url in await workers_of(router.url)) != listed:
            return False
    return True


async def test_a_self_registered_worker_joins_every_replicas_pool_in_its_role(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    configured = cluster_factory(prefill=1, decode=1, speed=0.0)
    async with replicas(configured, etcd_server, 2) as routers:
        url = _self_registered(cluster_factory, etcd_server).urls[0]
        await wait_until(lambda: _listed_by_all(routers, url, True), 10.0, "listed by all")
        for router in routers:
            assert (await workers_of(router.url))[url]["role"] == "decode"


async def test_a_self_registered_regular_worker_serves_its_model_through_every_replica(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    configured = cluster_factory(prefill=1, decode=1, speed=0.0)
    async with replicas(configured, etcd_server, 2) as routers:
        registered = cluster_factory(
            prefill=0, decode=0, regular=1, speed=0.0, etcd=etcd_server.url,
            cluster_name=CLUSTER, etcd_lease_ttl=LEASE_TTL_SECS,
            extra_args=("--served-model-name", "alone"),
        )  # fmt: skip
        url = registered.regular_urls[0]
        await wait_until(lambda: _listed_by_all(routers, url, True), 10.0, "listed by all")
        async with httpx.AsyncClient(timeout=10.0) as http:
            for router in routers:
                assert (await workers_of(router.url))[url]["role"] == "regular"
                body = {"model": "alone", "prompt": "hi", "max_tokens": 3}
                reply = await http.post(router.url + "/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["model"] == "alone"


async def test_a_killed_self_registered_worker_leaves_every_replicas_pool(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    configured = cluster_factory(prefill=1, decode=1, speed=0.0)
    async with replicas(configured, etcd_server, 2) as routers:
        registered = _self_registered(cluster_factory, etcd_server)
        url = registered.urls[0]
        await wait_until(lambda: _listed_by_all(routers, url, True), 10.0, "listed by all")
        registered.kill(url)
        await wait_until(
            lambda: _listed_by_all(routers, url, False),
            LEASE_TTL_SECS + EXPIRY_MARGIN_S,
            "dropped by every replica",
        )


async def test_a_self_registered_worker_converted_through_a_replica_stays_under_its_own_lease(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    configured = cluster_factory(prefill=1, decode=1, speed=0.0)
    async with replicas(configured, etcd_server, 2) as routers:
        registered = _self_registered(cluster_factory, etcd_server)
        url = registered.urls[0]
        key = ClusterKeys(CLUSTER).worker(url)
        await wait_until(lambda: _listed_by_all(routers, url, True), 10.0, "listed by all")
        async with aiohttp.ClientSession() as session:
            etcd = EtcdClient(session, etcd_server.url)
            before = await etcd.get(key)
            async with httpx.AsyncClient(timeout=30.0) as http:
                reply = await http.post(
                    routers[0].url + "/convert_pd_role", json={"server_url": url}
                )
            assert reply.status_code == 200 and reply.json()["status"] == "succeeded", reply.text
            after = await etcd.get(key)
        assert before is not None and after is not None
        assert after.lease == before.lease != 0
        assert WorkerRecord.decode(after.value).role == "prefill"
        registered.kill(url)
        await wait_until(
            lambda: _listed_by_all(routers, url, False),
            LEASE_TTL_SECS + EXPIRY_MARGIN_S,
            "dropped by every replica",
        )
