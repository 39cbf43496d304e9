"""A conversion's verify ends with one real request through the converted worker in its new role
(a canary) before clients are routed to it; a worker whose canary fails is switched back to its
old role, or left FAILED when that does not work either (pd_router/control/conversion/canary.py).

The failing canary is the reference worker's ``stale_bootstrap`` fault: the only decode never
receives KV from the newly converted prefill's bootstrap address (as SGLang 0.5.23's decodes do
after a prefill's round trip, docs/sglang-bugs.md), and runs without server_patch
(``native_only``), so the router cannot make it forget."""

from __future__ import annotations

import pytest

from pd_worker.cluster import WorkerCluster
from tests.conversion_helpers import convert, live_roles, pools, worker_entry
from tests.router_helpers import fault, generate_body, running_router

CANARY = {"conversion": {"canary_timeout_secs": 2.0}}


@pytest.fixture
def cluster(cluster_factory) -> WorkerCluster:
    return cluster_factory(prefill=1, decode=2, speed=0.0)


async def test_a_conversion_passes_its_canary_before_clients_get_the_worker(cluster):
    decode = cluster.decode_urls[1]
    async with running_router(cluster, **CANARY) as router, router.client() as http:
        response = await convert(http, server_url=decode, new_role="prefill")
        assert response.status_code == 200, response.text
        record = response.json()
        canary = [r for r in record["worker_replies"] if r["call"] == "canary"]
        assert canary and canary[0]["body"] == {"peer": cluster.decode_urls[0], "failures": {}}
        assert record["timings"]["canary_s"] < 2.0
        assert decode in (await pools(http))["prefill"]


async def test_a_failed_canary_switches_the_worker_back_to_its_old_pool(cluster):
    """The switch back to decode carries a decode peer's graph parameters: SGLang run without
    CUDA graphs asks for them on every switch to decode (the no_decode_graphs fault)."""
    decode, peer = cluster.decode_urls[1], cluster.decode_urls[0]
    await fault(
        peer, stale_bootstrap=f"127.0.0.1:{cluster.bootstrap_port(decode)}", native_only=True
    )
    await fault(decode, no_decode_graphs=True)
    async with running_router(cluster, **CANARY) as router, router.client() as http:
        response = await convert(http, server_url=decode, new_role="prefill")
        assert response.status_code == 400, response.text
        record = response.json()
        assert record["status"] == "restored", record
        assert record["message"].startswith("canary failed ("), record
        assert f"decode leg on {peer}: timed out" in record["message"], record
        assert record["message"].endswith("switched back to decode"), record
        assert decode in (await pools(http))["decode"]
        assert (await worker_entry(http, decode))["state"] == "active"
        await fault(peer, clear=True)
        await fault(decode, clear=True)
        assert decode in (await live_roles(cluster))[1]
        ok = await http.post("/generate", json=generate_body("after the canary", 4))
        assert ok.status_code == 200, ok.text


async def test_a_conversion_without_a_peer_of_the_other_role_skips_the_canary(cluster):
    """One prefill converted to decode leaves no prefill to meet: nothing to check it with
    (min_prefill 0 lets the pool empty)."""
    prefill = cluster.prefill_urls[0]
    settings = {"conversion": {"canary_timeout_secs": 2.0, "min_prefill": 0}}
    async with running_router(cluster, **settings) as router, router.client() as http:
        response = await convert(http, server_url=prefill, new_role="decode")
        assert response.status_code == 200, response.text
        canary = [r for r in response.json()["worker_replies"] if r["call"] == "canary"]
        assert canary[0]["body"] == {"peer": None, "failures": {}}


async def test_a_canary_that_meets_one_peer_passes_when_another_pair_is_stale(cluster_factory):
    """A decode that kept a round-tripped prefill's endpoints (plain SGLang cannot be told to
    forget) is that pair's fault, not the converted worker's: another decode meets it."""
    cluster = cluster_factory(prefill=1, decode=3, speed=0.0)
    converted, stale, good = cluster.decode_urls[2], cluster.decode_urls[0], cluster.decode_urls[1]
    await fault(
        stale, stale_bootstrap=f"127.0.0.1:{cluster.bootstrap_port(converted)}", native_only=True
    )
    async with running_router(cluster, **CANARY) as router, router.client() as http:
        response = await convert(http, server_url=converted, new_role="prefill")
        assert response.status_code == 200, response.text
        canary = [r for r in response.json()["worker_replies"] if r["call"] == "canary"]
        assert canary[0]["body"]["peer"] == good
        assert converted in (await pools(http))["prefill"]
