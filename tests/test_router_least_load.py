"""``least_load`` through the router, on real processes: a prefill that holds a real queue
(one batch slot, a slow forward, requests sent to it by another client behind the router's
back) is shown by its own ``/v1/loads``; the router that reads it sends that prefill fewer of a
burst than ``least_inflight``, which sees only its own requests, would. The same with two data
planes (``--workers 2``), the reports reaching them from the control process."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pd_worker.cluster import WorkerCluster
from tests.router_helpers import assert_paired, generate_body, running_router, wait_until
from tests.router_process import router_process

TOKENS = 2
# The queue held on the busy prefill, and the burst sent through the router meanwhile.
QUEUE = 30
BURST = 8
# Each forward takes 0.1 s and runs one prompt: the queue drains at ten requests a second.
SLOW_PREFILLS = {"speed": 1.0, "max_running_requests": 1, "prefill_batch_overhead_secs": 0.1}


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=1, **SLOW_PREFILLS)


async def waiting_on(url: str) -> int:
    async with httpx.AsyncClient(timeout=5.0) as http:
        loads = (await http.get(url + "/v1/loads")).json()["loads"]
    return sum(rank["num_waiting_reqs"] for rank in loads)


@contextlib.asynccontextmanager
async def queue_on(url: str) -> AsyncIterator[None]:
    """Another client's requests sent straight to the prefill at ``url`` (no KV handoff), held
    in its queue until it works through them; waits for them on exit."""
    async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        sent = [
            asyncio.create_task(http.post("/generate", json=generate_body(f"elsewhere {i}", 1)))
            for i in range(QUEUE)
        ]
        await wait_until(lambda: queued(url), 5.0, "the queue on the busy prefill")
        try:
            yield
        finally:
            await asyncio.gather(*sent)


async def queued(url: str) -> bool:
    return await waiting_on(url) >= QUEUE // 2


async def reported_waiting(router_url: str, url: str) -> int | None:
    async with httpx.AsyncClient(base_url=router_url, timeout=5.0) as http:
        workers = (await http.get("/workers")).json()["workers"]
    report = next(w for w in workers if w["url"] == url)["reported_load"]
    return None if report is None else report["waiting"]


async def burst(router_url: str, name: str) -> Counter[str]:
    """``BURST`` requests at once, each on its own connection (spread over the data planes);
    how many each prefill served."""

    async def one(i: int) -> str:
        prompt = f"{name} {i}"
        async with httpx.AsyncClient(base_url=router_url, timeout=30.0) as http:
            answer = await http.post("/generate", json=generate_body(prompt, TOKENS))
        assert answer.status_code == 200, answer.text
        return assert_paired(answer.json(), prompt, TOKENS)

    return Counter(await asyncio.gather(*(one(i) for i in range(BURST))))


async def served_by_busy(cluster: WorkerCluster, router_url: str, policy: str) -> int:
    """How many of a burst the busy prefill (the first) served under ``policy``, its queue
    held meanwhile; with ``least_load`` the burst waits until the router read the queue."""
    busy = cluster.prefill_urls[0]
    async with queue_on(busy):
        if policy == "least_load":

            async def seen() -> bool:
                return (await reported_waiting(router_url, busy) or 0) >= QUEUE // 2

            await wait_until(seen, 5.0, "the busy prefill's report in /workers")
            # The control side pushes a changed report to the data planes within 25 ms.
            await asyncio.sleep(0.1)
        served = await burst(router_url, policy)
    return served[busy]


@contextlib.asynccontextmanager
async def router_url(cluster: WorkerCluster, processes: int, policy: str) -> AsyncIterator[str]:
    overrides: dict[str, Any] = {"prefill_policy": policy}
    if processes == 1:
        async with running_router(cluster, **overrides) as router:
            yield router.url
    else:
        async with router_process(
            prefill=cluster.prefill_urls,
            decode=cluster.decode_urls,
            server={"workers": processes},
            **overrides,
        ) as router:
            yield router.url


@pytest.mark.parametrize("processes", [1, 2], ids=["one process", "two data planes"])
async def test_a_prefill_reporting_a_long_queue_gets_less_under_least_load(cluster, processes):
    async with router_url(cluster, processes, "least_inflight") as url:
        blind = await served_by_busy(cluster, url, "least_inflight")
    async with router_url(cluster, processes, "least_load") as url:
        informed = await served_by_busy(cluster, url, "least_load")
    assert informed < blind
    assert informed <= 1, f"least_load sent {informed} of {BURST} to the prefill with a queue"


async def test_a_router_without_least_load_reads_no_reports(cluster):
    async with running_router(cluster, policy="least_inflight") as router:
        await asyncio.sleep(0.3)
        assert await reported_waiting(router.url, cluster.prefill_urls[0]) is None
