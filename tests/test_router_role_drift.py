"""Role drift: a worker whose role, process or admission changes without this router (a second
router converts it, an operator switches or drains it, a supervisor restarts it in another role)
is noticed by the health probes' live-role read and moved before more traffic goes there; the
request path's suspicion (a 421 from an extension worker) reads it at once. Real reference
workers and real routers on loopback."""

from __future__ import annotations

import asyncio

import httpx

from pd_router.control.workers import Role
from tests.conversion_helpers import converted_by_a_second_router
from tests.router_helpers import (
    assert_paired,
    fault,
    generate_body,
    running_router,
    wait_until,
)

TOKENS = 4
TO_PREFILL = {"new_role": "prefill"}
NEVER_UNHEALTHY = {"failure_threshold": 1000}  # a restart must be noticed without the threshold


async def kv_sources(http: httpx.AsyncClient, count: int) -> set[str]:
    """The prefills ``count`` checked requests through the router pulled their KV from."""
    sources = set()
    for n in range(count):
        prompt = f"drift {n}"
        response = await http.post("/generate", json=generate_body(prompt, TOKENS))
        assert response.status_code == 200, response.text
        sources.add(assert_paired(response.json(), prompt, TOKENS))
    return sources


async def test_worker_switched_by_a_second_router_is_moved_and_no_request_fails(cluster_factory):
    cluster = cluster_factory(
        prefill=2, decode=2, speed=1.0, switch_secs=0.5,
        bootstrap_timeout_secs=3.0, room_timeout_secs=3.0,
    )  # fmt: skip
    moved = cluster.decode_urls[0]
    async with converted_by_a_second_router(
        cluster, moved, within=5.0, prefill_policy="round_robin"
    ) as (unaware, load):
        assert load.failed == 0, load.errors[:3]
        worker = unaware.state.registry.get(moved)
        assert worker.healthy and worker.bootstrap_port == cluster.bootstrap_port(moved)
        async with unaware.client() as http:
            assert moved in await kv_sources(http, 6)


async def test_worker_switched_on_its_own_pd_role_switch_joins_its_new_pool(cluster_factory):
    cluster = cluster_factory(prefill=2, decode=2, speed=0.0)
    switched = cluster.decode_urls[0]
    async with running_router(cluster, prefill_policy="round_robin") as router:
        worker = router.state.registry.get(switched)
        async with httpx.AsyncClient(timeout=10.0) as operator:
            reply = await operator.post(switched + "/pd_role_switch", json=TO_PREFILL)
        assert reply.json()["success"]
        await wait_until(lambda: worker.role is Role.PREFILL, 5.0, "router moved it")
        assert worker not in router.state.registry.selectable(Role.DECODE)
        async with router.client() as http:
            assert switched in await kv_sources(http, 6)


async def test_worker_restarted_in_another_role_is_moved_and_served(cluster_factory):
    """Probes that would never count it unhealthy: the restart's refused connections take it out
    at once (proof enough), and the first probe that answers moves it to its new role."""
    cluster = cluster_factory(prefill=2, decode=2, speed=0.0)
    restarted = cluster.decode_urls[0]
    async with running_router(
        cluster, prefill_policy="round_robin", health=NEVER_UNHEALTHY
    ) as router:
        worker = router.state.registry.get(restarted)
        await asyncio.to_thread(cluster.restart, restarted, "prefill")
        await wait_until(lambda: worker.role is Role.PREFILL, 5.0, "router moved it")
        await wait_until(lambda: worker.healthy, 5.0, "healthy in its new role")
        async with router.client() as http:
            assert restarted in await kv_sources(http, 6)


async def test_prefill_restarted_with_another_bootstrap_port_is_paired_through_it(
    cluster_factory, free_port
):
    cluster = cluster_factory(prefill=1, decode=1, speed=0.0)
    prefill = cluster.prefill_urls[0]
    port = free_port()
    async with running_router(cluster, health=NEVER_UNHEALTHY) as router:
        worker = router.state.registry.get(prefill)
        await asyncio.to_thread(cluster.restart, prefill, None, port)
        await wait_until(lambda: worker.bootstrap_port == port, 5.0, "new bootstrap port used")
        # Out at once by the restart's refused connections, back with the probe that answered.
        await wait_until(lambda: worker.selectable, 5.0, "selectable again")
        async with router.client() as http:
            assert await kv_sources(http, 2) == {prefill}


async def test_worker_drained_by_another_router_is_out_of_selection_until_it_admits(
    cluster_factory,
):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    drained = cluster.decode_urls[0]
    async with running_router(cluster) as router, httpx.AsyncClient(timeout=5.0) as other:
        worker = router.state.registry.get(drained)
        await other.post(drained + "/pd_drain", json={"drain": True})
        await wait_until(lambda: not worker.admitting, 5.0, "drained worker out of selection")
        assert worker not in router.state.registry.selectable(Role.DECODE)
        assert worker.healthy  # its in-flight requests are left to finish
        await other.post(drained + "/pd_drain", json={"drain": False})
        await wait_until(lambda: worker.admitting, 5.0, "worker back once it admits")
        assert worker in router.state.registry.selectable(Role.DECODE)


async def test_suspected_worker_is_read_and_moved_at_once(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    switched = cluster.decode_urls[0]
    async with running_router(cluster, health={"interval_secs": 60.0}) as router:
        worker = router.state.registry.get(switched)
        async with httpx.AsyncClient(timeout=10.0) as operator:
            await operator.post(switched + "/pd_role_switch", json=TO_PREFILL)
        first = router.state.health.suspect(worker)
        assert router.state.health.suspect(worker) is first  # one read in flight per worker
        await asyncio.wait_for(first, 5.0)
        assert worker.role is Role.PREFILL
        assert worker.bootstrap_port == cluster.bootstrap_port(switched)


async def test_worker_that_stops_serving_the_extension_routes_is_read_natively(
    cluster_factory,
):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    url = cluster.decode_urls[0]
    async with running_router(cluster, health={"interval_secs": 60.0}) as router:
        worker = router.state.registry.get(url)
        assert worker.has_extensions is True
        await fault(url, native_only=True)
        assert await router.state.health.check(worker)
        assert worker.has_extensions is False
        assert worker.role is Role.DECODE
