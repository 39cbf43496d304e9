"""``pd-worker serve --etcd URL --cluster NAME``: real worker processes register themselves in a
real etcd under a lease, and their record goes with them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from pd_protocol.cluster import ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import EtcdClient, KeyValue
from pd_worker.cluster import WorkerCluster
from tests.conftest import ClusterFactory
from tests.etcd_helpers import EtcdServer

CLUSTER = "c1"
KEYS = ClusterKeys(CLUSTER)
TTL = 2
# A killed worker's lease expires after TTL seconds; the margin covers a busy 2-core machine.
EXPIRY_MARGIN_S = 3.0
WAIT_S = 10.0


@pytest_asyncio.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with aiohttp.ClientSession() as session:
        yield EtcdClient(session, etcd_server.url, timeout=2.0)


@pytest.fixture
def registered_cluster(
    etcd_server: EtcdServer, cluster_factory: ClusterFactory
) -> Callable[..., WorkerCluster]:
    def make(prefill: int = 1, decode: int = 0) -> WorkerCluster:
        return cluster_factory(
            prefill=prefill,
            decode=decode,
            etcd=etcd_server.url,
            cluster_name=CLUSTER,
            etcd_lease_ttl=TTL,
        )

    return make


async def _stored(etcd: EtcdClient, url: str) -> KeyValue | None:
    return await etcd.get(KEYS.worker(url))


async def _record(etcd: EtcdClient, url: str) -> WorkerRecord | None:
    kv = await _stored(etcd, url)
    return None if kv is None else WorkerRecord.decode(kv.value)


async def _registered(etcd: EtcdClient, url: str) -> KeyValue:
    """The worker's record, once it is there: a worker answers /health (so its cluster has
    started) a moment before its record is put."""
    stored: KeyValue | None = None

    async def present() -> bool:
        nonlocal stored
        stored = await _stored(etcd, url)
        return stored is not None

    await _until(present, f"the record of {url}", within=WAIT_S)
    if stored is None:
        raise AssertionError(f"no record of {url}")
    return stored


async def _put_again(etcd: EtcdClient, url: str, old_lease: int) -> WorkerRecord:
    """The record of ``url``, once it is put under another lease than ``old_lease``."""

    async def put_again() -> bool:
        kv = await _stored(etcd, url)
        return kv is not None and kv.lease != old_lease

    await _until(put_again, "the record put again under a new lease", within=WAIT_S)
    record = await _record(etcd, url)
    assert record is not None
    return record


async def _until(condition: Callable[[], Awaitable[bool]], what: str, within: float) -> float:
    """Seconds until ``condition`` held (AssertionError after ``within``)."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if await condition():
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {within}s: {what}")


async def test_a_worker_started_with_etcd_appears_with_its_role_and_bootstrap_port(
    registered_cluster: Callable[..., WorkerCluster], etcd: EtcdClient
) -> None:
    cluster = registered_cluster(prefill=1, decode=1)
    for worker in cluster.workers:
        kv = await _registered(etcd, worker.url)
        assert WorkerRecord.decode(kv.value) == WorkerRecord(
            url=worker.url, role=worker.role, bootstrap_port=worker.bootstrap_port, source="self"
        )
        assert kv.lease != 0


async def test_a_regular_worker_started_with_etcd_appears_as_regular_with_no_bootstrap_port(
    etcd_server: EtcdServer, cluster_factory: ClusterFactory, etcd: EtcdClient
) -> None:
    cluster = cluster_factory(
        prefill=0, decode=0, regular=1, etcd=etcd_server.url, cluster_name=CLUSTER,
        etcd_lease_ttl=TTL,
    )  # fmt: skip
    url = cluster.regular_urls[0]
    kv = await _registered(etcd, url)
    assert WorkerRecord.decode(kv.value) == WorkerRecord(
        url=url, role="regular", bootstrap_port=None, source="self"
    )


async def test_a_killed_workers_record_goes_within_the_lease_ttl(
    registered_cluster: Callable[..., WorkerCluster], etcd: EtcdClient
) -> None:
    cluster = registered_cluster()
    url = cluster.urls[0]
    await _registered(etcd, url)
    cluster.kill(url)

    async def gone() -> bool:
        return await _stored(etcd, url) is None

    await _until(gone, "the killed worker's record gone", within=TTL + EXPIRY_MARGIN_S)


async def test_a_terminated_workers_record_goes_at_once(
    registered_cluster: Callable[..., WorkerCluster], etcd: EtcdClient
) -> None:
    cluster = registered_cluster()
    url = cluster.urls[0]
    await _registered(etcd, url)
    cluster.terminate(url)
    assert await _stored(etcd, url) is None


async def test_a_record_a_router_changed_under_the_workers_lease_is_kept_alive(
    registered_cluster: Callable[..., WorkerCluster], etcd: EtcdClient
) -> None:
    url = registered_cluster().urls[0]
    stored = await _registered(etcd, url)
    converted = WorkerRecord.decode(stored.value).evolve(role="decode", epoch=1)
    await etcd.put(KEYS.worker(url), converted.encode(), lease=stored.lease)
    await asyncio.sleep(2 * TTL)
    assert await _record(etcd, url) == converted


async def test_a_record_put_again_after_a_role_switch_carries_the_new_role(
    registered_cluster: Callable[..., WorkerCluster], etcd: EtcdClient
) -> None:
    url = registered_cluster().urls[0]
    first = await _registered(etcd, url)
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        reply = await client.post(
            url + "/pd_role_switch",
            json={"new_role": "decode", "decode_cuda_graph_memory_gb": 0.1},
        )
    assert reply.json()["success"] is True
    # The lease is lost (as when etcd forgot it): the worker registers again, in its live role.
    await etcd.revoke_lease(first.lease)

    record = await _put_again(etcd, url, first.lease)
    assert record.role == "decode"


async def test_the_record_is_there_after_etcd_was_stopped_past_the_ttl_and_restarted(
    registered_cluster: Callable[..., WorkerCluster],
    etcd_server: EtcdServer,
    etcd: EtcdClient,
) -> None:
    url = registered_cluster().urls[0]
    await _registered(etcd, url)
    etcd_server.stop()
    await asyncio.sleep(TTL + 1)
    etcd_server.start()
    await asyncio.sleep(2 * TTL)
    record = await _record(etcd, url)
    assert record is not None and record.role == "prefill"


async def test_the_workers_metrics_say_how_long_an_etcd_stall_left_it_unregistered(
    registered_cluster: Callable[..., WorkerCluster],
    etcd_server: EtcdServer,
    etcd: EtcdClient,
) -> None:
    url = registered_cluster().urls[0]
    first = await _registered(etcd, url)
    assert await _registration_metrics(url) == {
        "pd_worker_registered": 1.0,
        "pd_worker_registration_lapses_total": 0.0,
        "pd_worker_unregistered_seconds_total": 0.0,
    }
    with etcd_server.stalled():
        await asyncio.sleep(TTL + 1.5)

    await _put_again(etcd, url, first.lease)
    metrics = await _registration_metrics(url)
    assert metrics["pd_worker_registration_lapses_total"] == 1.0
    assert metrics["pd_worker_unregistered_seconds_total"] > 0.0


async def _registration_metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        text = (await client.get(url + "/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("pd_worker_")
    }


def test_etcd_without_a_cluster_name_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pd_worker", "serve", "--etcd", "http://127.0.0.1:2379"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert result.returncode == 2
    assert "--etcd needs --cluster" in result.stderr
