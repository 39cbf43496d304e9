"""What an operator sees and may do is what the router will do: a worker that recovered shows no
old probe error; conversions the router would refuse (a pool at its minimum, a worker that
cannot switch) have no Convert button and are refused with 409 before anything changes; a
removal that would leave a pool under its minimum is refused unless forced. Real reference
workers and a real router on loopback."""

from __future__ import annotations

import httpx
import pytest

from tests.router_helpers import fault, running_router, wait_until


async def workers_by_url(http: httpx.AsyncClient) -> dict[str, dict]:
    return {w["url"]: w for w in (await http.get("/workers")).json()["workers"]}


async def status_by_url(http: httpx.AsyncClient) -> dict[str, dict]:
    return {w["url"]: w for w in (await http.get("/status")).json()["workers"]}


@pytest.fixture
def mixed(cluster_factory):
    """1 prefill + 2 decodes that can switch, and 1 decode launched without
    --enable-pd-role-switch."""
    switching = cluster_factory(prefill=1, decode=2)
    fixed = cluster_factory(prefill=0, decode=1, enable_pd_role_switch=False)
    return switching, fixed.decode_urls[0]


async def test_recovered_worker_shows_no_old_probe_error(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=1)
    decode = cluster.decode_urls[0]
    async with running_router(cluster) as router, router.client() as http:
        worker = router.state.registry.get(decode)
        await fault(decode, unhealthy=True)
        await wait_until(lambda: not worker.healthy, 5.0, "the decode is unhealthy")
        assert "503" in (await workers_by_url(http))[decode]["last_error"]
        await fault(decode, unhealthy=False)
        await wait_until(lambda: worker.healthy, 5.0, "the decode recovered")
        assert (await workers_by_url(http))[decode]["last_error"] is None
        assert (await status_by_url(http))[decode]["last_error"] is None


async def test_conversions_the_router_would_refuse_are_marked_on_the_status(mixed):
    switching, fixed = mixed
    prefill = switching.prefill_urls[0]
    decodes = [*switching.decode_urls, fixed]
    async with (
        running_router(prefill=[prefill], decode=decodes) as router,
        router.client() as http,
    ):
        await wait_until(
            lambda: router.state.registry.get(fixed).switch_supported is False, 5.0, "probed"
        )
        status = await status_by_url(http)
    assert "minimum is 1" in status[prefill]["convert_refused"]
    assert "cannot switch roles" in status[fixed]["convert_refused"]
    assert [status[url]["convert_refused"] for url in switching.decode_urls] == [None, None]


async def test_worker_that_cannot_switch_is_refused_before_it_is_drained(mixed):
    switching, fixed = mixed
    async with (
        running_router(prefill=switching.prefill_urls, decode=[*switching.decode_urls, fixed]) as r,
        r.client() as http,
        httpx.AsyncClient(timeout=5.0) as direct,
    ):
        reply = await http.post("/convert_pd_role", json={"server_url": fixed})
        assert reply.status_code == 409, reply.text
        assert reply.json()["error"]["reason"] == "switch_not_supported"
        worker = r.state.registry.get(fixed)
        assert (worker.state.value, worker.role.value) == ("active", "decode")
        assert (await direct.get(fixed + "/pd_role")).json()["draining"] is False
        assert (await http.get("/conversions")).json()["conversions"] == []


async def test_removing_the_last_decode_is_refused_unless_forced(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=1)
    decode = cluster.decode_urls[0]
    async with running_router(cluster) as router, router.client() as http:
        refused = await http.delete("/workers", params={"url": decode})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["reason"] == "min_decode"
        assert "force=true" in refused.json()["error"]["message"]
        assert decode in await workers_by_url(http)
        forced = await http.delete("/workers", params={"url": decode, "force": "true"})
        assert forced.status_code == 200, forced.text
        assert decode not in await workers_by_url(http)


async def test_removing_an_unhealthy_worker_of_a_pool_at_its_minimum_is_allowed(
    cluster_factory, free_port
):
    cluster = cluster_factory(prefill=1, decode=1)
    gone = f"http://127.0.0.1:{free_port()}"
    async with (
        running_router(cluster, decode=[*cluster.decode_urls, gone]) as router,
        router.client() as http,
    ):
        await wait_until(lambda: not router.state.registry.get(gone).healthy, 5.0, "unhealthy")
        reply = await http.delete("/workers", params={"url": gone})
        assert reply.status_code == 200, reply.text


async def test_prefill_pointed_at_another_router_is_refused_naming_it(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=1)
    async with (
        running_router(cluster) as front,
        running_router(prefill=[front.url], decode=cluster.decode_urls) as router,
        router.client() as http,
    ):
        worker = router.state.registry.get(front.url)
        await wait_until(lambda: worker.last_error is not None, 5.0, "the probe read it")
        assert (worker.role.value, worker.healthy) == ("prefill", False)
        assert "is a PD router" in (await workers_by_url(http))[front.url]["last_error"]
        reply = await http.post("/generate", json={"text": "x"})
        assert reply.status_code == 503
