"""The admin worker API (list, add, remove) and the admin key, against real workers."""

from __future__ import annotations

import asyncio
from urllib.parse import quote

import pytest

from tests.router_helpers import assert_paired, generate_body, running_router, wait_until

TOKENS = 2
SLOW_TOKENS = 100  # about 1 s of decoding at speed 1


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=2, speed=0.0)


async def test_list_workers_shows_every_field(cluster):
    async with running_router(cluster) as router, router.client() as http:
        listing = (await http.get("/workers")).json()
    assert {w["url"] for w in listing["workers"]} == set(cluster.urls)
    assert listing["selectable"] == {"prefill": 1, "decode": 2}
    for worker in listing["workers"]:
        assert {"id", "role", "bootstrap_port", "state", "healthy", "inflight", "circuit"} <= set(
            worker
        )


async def test_added_worker_is_probed_and_serves(cluster):
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    async with (
        running_router(cluster, prefill=[prefill], decode=[decode]) as router,
        router.client() as http,
    ):
        other = cluster.decode_urls[1]
        added = await http.post("/workers", json={"url": other, "role": "decode"})
        assert added.status_code == 201
        assert added.json()["healthy"] is True
        removed = await http.delete(f"/workers/{quote(decode, safe='')}")
        assert removed.status_code == 200
        response = await http.post("/generate", json=generate_body("via added", TOKENS))
        assert_paired(response.json(), "via added", TOKENS)


async def test_adding_a_known_worker_is_a_conflict(cluster):
    async with running_router(cluster) as router, router.client() as http:
        again = await http.post("/workers", json={"url": cluster.decode_urls[0], "role": "decode"})
        assert again.status_code == 409
        assert again.json()["error"]["type"] == "conflict"


@pytest.mark.parametrize(
    "body",
    [
        {"role": "decode"},
        {"url": 5, "role": "decode"},
        {"url": "ftp://x:1", "role": "decode"},
        {"url": "http://127.0.0.1:9", "role": "mixed"},
        {"url": "http://127.0.0.1:9", "role": "prefill", "bootstrap_port": 70000},
    ],
)
async def test_adding_a_bad_worker_is_a_400(cluster, body):
    async with running_router(cluster) as router, router.client() as http:
        response = await http.post("/workers", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["message"]


async def test_removing_an_unknown_worker_is_a_404(cluster):
    async with running_router(cluster) as router, router.client() as http:
        response = await http.delete("/workers/w999")
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found"


async def test_worker_can_be_removed_by_id_or_url(cluster):
    async with running_router(cluster) as router, router.client() as http:
        first, second = (router.state.registry.get(u) for u in cluster.decode_urls)
        assert (await http.delete(f"/workers/{first.id}")).status_code == 200
        removal = await http.delete("/workers", params={"url": second.url, "force": "true"})
        assert removal.status_code == 200  # the last decode: forced past min_decode
        assert [w["url"] for w in (await http.get("/workers")).json()["workers"]] == [
            cluster.prefill_urls[0]
        ]


async def test_removal_stops_routing_and_waits_for_in_flight_requests(cluster_factory):
    slow = cluster_factory(prefill=1, decode=2, speed=1.0)
    async with running_router(slow) as router, router.client() as http:
        registry = router.state.registry
        running = asyncio.create_task(
            http.post("/generate", json=generate_body("in flight", SLOW_TOKENS))
        )
        await wait_until(
            lambda: any(registry.get(u).inflight for u in slow.decode_urls), 5.0, "dispatched"
        )
        busy = next(registry.get(u) for u in slow.decode_urls if registry.get(u).inflight)
        removal = asyncio.create_task(http.delete(f"/workers/{busy.id}"))
        await wait_until(lambda: not busy.selectable, 5.0, "busy decode out of the pool")
        meanwhile = await http.post("/generate", json=generate_body("elsewhere", TOKENS))
        assert meanwhile.status_code == 200
        assert not removal.done()
        finished = await running
        assert finished.status_code == 200
        removed = await removal
        assert removed.status_code == 200
        assert removed.json()["forced"] is False
        assert busy.url not in [w.url for w in registry]


async def test_admin_api_needs_the_key_when_one_is_set(cluster):
    async with running_router(cluster, admin_api_key="s3cret") as router, router.client() as http:
        assert (await http.get("/workers")).status_code == 401
        wrong = await http.get("/workers", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        right = await http.get("/workers", headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200
        served = await http.post("/generate", json=generate_body("no key needed", TOKENS))
        assert served.status_code == 200
