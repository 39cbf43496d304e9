"""Worker lifecycle through a real router in front of reference worker processes: a removal and a
conversion of the same worker (exactly one of them gets it, nothing of the other is left behind),
a worker being removed (REMOVING, out of the pools, not convertible), and the registry telling
its listeners when a worker stops taking requests."""

from __future__ import annotations

import asyncio

import pytest

from pd_router.control.workers import Unavailability, Worker
from tests.conversion_helpers import (
    Call,
    arranged_router,
    convert,
    pools,
    sample,
    send_together,
    start_long_request_on_a_decode,
    worker_entry,
)
from tests.router_helpers import fault, wait_until

SPEED = 0.05


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=2, speed=SPEED)


@pytest.fixture
async def router(cluster):
    """A router over the cluster's live roles, arranged back to one prefill and two decodes."""
    async with arranged_router(cluster, prefill=1) as r:
        yield r
    for url in cluster.urls:
        await fault(url, clear=True)


@pytest.fixture
async def http(router):
    async with router.client() as client:
        yield client


async def remove_a_busy_decode(http):
    """A decode busy with a generation of about a second, and its removal, waiting for that
    generation; returns (generation task, decode url, removal task) once the decode is
    REMOVING."""
    request, busy = await start_long_request_on_a_decode(http)
    removal = asyncio.create_task(http.delete("/workers", params={"url": busy}))
    await wait_until(
        lambda: sample(http, "pd_router_worker_state", worker=busy, state="removing"),
        5.0,
        "worker_state removing",
    )
    return request, busy, removal


@pytest.mark.parametrize("removal_first", [True, False], ids=["removal-first", "conversion-first"])
async def test_a_removal_and_a_conversion_sent_together_exactly_one_wins(
    router, http, removal_first
):
    decode = (await pools(http))["decode"][0]
    removal = Call("DELETE", f"/workers/{router.state.registry.get(decode).id}")
    conversion = Call("POST", "/convert_pd_role", {"server_url": decode})
    if removal_first:
        removed, converted = await send_together(router.url, [removal, conversion])
    else:
        converted, removed = await send_together(router.url, [conversion, removal])
    assert sorted([removed.status, converted.status]) == [200, 409]
    if removed.status == 200:
        assert converted.body["error"]["reason"] == "removing"
        assert decode not in [w["url"] for w in (await http.get("/workers")).json()["workers"]]
        assert f'worker="{decode}"' not in (await http.get("/metrics")).text
        assert (await http.get("/conversions")).json()["active"] == []
    else:
        assert removed.body["error"]["reason"] == "already_converting"
        entry = await worker_entry(http, decode)
        assert (entry["role"], entry["state"], entry["conversion"]) == ("prefill", "active", None)
        assert await sample(http, "pd_router_worker_state", worker=decode, state="active") == 1.0


async def test_a_worker_being_removed_is_removing_out_of_its_pool_until_its_requests_end(http):
    request, busy, removal = await remove_a_busy_decode(http)
    assert (await worker_entry(http, busy))["state"] == "removing"
    assert await sample(http, "pd_router_pool_size", role="decode") == 1.0
    assert not removal.done()
    assert (await request).status_code == 200
    assert (await removal).json()["forced"] is False
    assert f'worker="{busy}"' not in (await http.get("/metrics")).text


async def test_a_worker_being_removed_cannot_be_converted(http):
    request, busy, removal = await remove_a_busy_decode(http)
    refused = await convert(http, server_url=busy)
    assert refused.status_code == 409
    assert refused.json()["error"]["reason"] == "removing"
    assert (await request).status_code == 200
    assert (await removal).status_code == 200


async def test_a_second_removal_of_a_worker_being_removed_is_refused(http):
    request, busy, removal = await remove_a_busy_decode(http)
    again = await http.delete("/workers", params={"url": busy})
    assert again.status_code == 409
    assert again.json()["error"]["reason"] == "removing"
    assert (await request).status_code == 200
    assert (await removal).status_code == 200


async def test_listeners_hear_when_a_worker_turns_unhealthy_and_when_it_is_removed(router, http):
    heard: list[tuple[str, Unavailability]] = []

    def listener(worker: Worker, why: Unavailability) -> None:
        heard.append((worker.url, why))

    router.state.registry.on_unavailable(listener)
    decode = (await pools(http))["decode"][0]
    await fault(decode, unhealthy=True)
    await wait_until(lambda: heard, 5.0, "a listener told of the unhealthy decode")
    assert heard == [(decode, Unavailability.UNHEALTHY)]
    assert (await http.delete("/workers", params={"url": decode})).status_code == 200
    assert heard == [(decode, Unavailability.UNHEALTHY), (decode, Unavailability.REMOVED)]
