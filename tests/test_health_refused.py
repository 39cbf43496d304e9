"""A worker whose connection is refused (its process is gone) is unhealthy at once, whoever finds
out: a health probe, or a request's leg that could not connect. The failure threshold is for
answers that may be lost on the way (timeouts, errors), not for a port nobody listens on."""

from __future__ import annotations

import httpx
import pytest

from tests.router_helpers import generate_body, running_router, wait_until

# A threshold the test would wait far longer than its bound for, were it applied.
SLOW_HEALTH = {"interval_secs": 0.5, "timeout_secs": 1.0, "failure_threshold": 20}


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=2)


async def healthy(http: httpx.AsyncClient, url: str) -> bool:
    workers = (await http.get("/workers")).json()["workers"]
    return next(w for w in workers if w["url"] == url)["healthy"]


async def test_a_probe_refused_marks_the_worker_unhealthy_at_once(cluster):
    gone = cluster.decode_urls[0]
    async with running_router(cluster, health=SLOW_HEALTH) as router, router.client() as http:
        cluster.kill(gone)
        await wait_until(lambda: not_(healthy(http, gone)), 2.0, "unhealthy after one probe")


async def test_a_leg_refused_marks_the_worker_unhealthy_at_once(cluster):
    gone = cluster.decode_urls[0]
    # No probe within the test: only the requests can find out.
    probes_asleep = {**SLOW_HEALTH, "interval_secs": 60.0}
    async with (
        running_router(cluster, health=probes_asleep, decode_policy="round_robin") as router,
        router.client() as http,
    ):
        cluster.kill(gone)
        for i in range(4):
            reply = await http.post("/generate", json=generate_body(f"after {i}", 2))
            assert reply.status_code == 200, reply.text
        await wait_until(lambda: not_(healthy(http, gone)), 1.0, "unhealthy after a leg")


async def not_(value) -> bool:
    return not await value
