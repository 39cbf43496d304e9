"""Workers whose records go from etcd without a removal while the replicas reach them and they
serve, through real replicas: the last healthy worker of its pool stays in every replica's
pool past the grace period, ``GET /cluster`` and the log say why, and a removal through the
API still takes it out of every replica; when etcd lost its data, the workers given on the
command line are put back. (The grace period itself, failed probes, records put back:
tests/unit/test_cluster_mirror.py.)"""

from __future__ import annotations

import asyncio
import shutil

import aiohttp
import httpx

from pd_protocol.cluster import ClusterKeys
from pd_protocol.etcd_client import EtcdClient
from tests.conftest import ClusterFactory
from tests.etcd_helpers import EtcdServer
from tests.replica_helpers import LEASE_TTL_SECS, cluster_view, replicas, workers_of
from tests.router_helpers import generate_body, wait_until
from tests.router_process import RouterProcess

KEYS = ClusterKeys("test")  # the cluster tests/replica_helpers.py starts
# A replica's grace for a worker without a record: two of its lease TTLs.
GRACE_SECS = 2 * LEASE_TTL_SECS
# Margin for a busy 2-core machine past a deadline the replica keeps.
MARGIN_SECS = 4.0
KEPT = "the last healthy prefill worker"


async def _kept(router: RouterProcess, url: str) -> bool:
    entry = (await cluster_view(router.url))["unregistered"].get(url)
    return entry is not None and entry["kept"] == KEPT


async def test_the_last_healthy_worker_of_a_pool_stays_on_every_replica_without_a_record(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    workers = cluster_factory(prefill=1, decode=1, speed=0.0)
    (prefill,) = workers.prefill_urls
    async with replicas(workers, etcd_server, 2) as routers:
        async with aiohttp.ClientSession() as session:
            await EtcdClient(session, etcd_server.url).delete(KEYS.worker(prefill))
        await asyncio.sleep(GRACE_SECS)
        for router in routers:
            await wait_until(lambda r=router: _kept(r, prefill), MARGIN_SECS, "kept")
            assert (await workers_of(router.url))[prefill]["state"] == "active"
            assert f"kept: {KEPT}" in router.log_text()
            async with router.client() as http:
                reply = await http.post("/generate", json=generate_body("still served", 2))
            assert reply.status_code == 200, reply.text
        async with httpx.AsyncClient(timeout=30.0) as http:
            removed = await http.delete(
                routers[0].url + "/workers", params={"url": prefill, "force": "true"}
            )
        assert removed.status_code == 200, removed.text

        async def gone_everywhere() -> bool:
            for router in routers:
                if prefill in await workers_of(router.url):
                    return False
            return True

        await wait_until(gone_everywhere, MARGIN_SECS, "removed on every replica")
        for router in routers:
            assert (await cluster_view(router.url))["unregistered"] == {}


async def test_a_worker_serving_without_a_record_is_registered_again_through_the_api(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    workers = cluster_factory(prefill=1, decode=2, speed=0.0)
    decode = workers.decode_urls[0]
    async with replicas(workers, etcd_server, 1) as (router,), aiohttp.ClientSession() as session:
        etcd = EtcdClient(session, etcd_server.url)
        await etcd.delete(KEYS.worker(decode))

        async def unregistered() -> bool:
            return decode in (await cluster_view(router.url))["unregistered"]

        await wait_until(unregistered, 2.0, "seen without a record")
        async with router.client() as http:
            added = await http.post("/workers", json={"url": decode, "role": "decode"})
        assert added.status_code == 201, added.text
        assert await etcd.get(KEYS.worker(decode)) is not None

        async def registered() -> bool:
            return (await cluster_view(router.url))["unregistered"] == {}

        await wait_until(registered, 2.0, "registered again")
        await asyncio.sleep(GRACE_SECS)
        assert (await workers_of(router.url))[decode]["state"] == "active"


async def test_the_workers_of_the_command_line_are_put_back_when_etcd_lost_its_data(
    cluster_factory: ClusterFactory, etcd_server: EtcdServer
) -> None:
    workers = cluster_factory(prefill=1, decode=2, speed=0.0)
    async with replicas(workers, etcd_server, 1) as (router,):
        await asyncio.to_thread(etcd_server.stop)
        shutil.rmtree(etcd_server.data_dir)
        await asyncio.to_thread(etcd_server.start)
        async with aiohttp.ClientSession() as session:
            etcd = EtcdClient(session, etcd_server.url)

            async def put_back() -> bool:
                records, _ = await etcd.get_prefix(KEYS.workers)
                return len(records) == len(workers.urls)

            await wait_until(put_back, MARGIN_SECS, "every configured worker's record")
        await asyncio.sleep(GRACE_SECS + 1.0)
        listed = await workers_of(router.url)
        states = {url: listed.get(url, {}).get("state") for url in workers.urls}
        assert states == dict.fromkeys(workers.urls, "active")
