"""Circuit recovery after an outage, against real reference workers: a burst after every
circuit of a pool opened is served (the pool's circuits are tried rather than answering 503),
and a worker the health probes saw recover or restart gets its circuit closed without waiting
for the cool-down."""

from __future__ import annotations

import asyncio

import httpx

from pd_router.control.workers import Role
from tests.router_helpers import fault, generate_body, running_router, wait_until

TOKENS = 4
BURST = 20
# Probes off: only the circuits judge the workers (with probes on, a killed worker's refused
# connection makes it unhealthy until a probe sees it again).
NO_PROBES = {"enabled": False}
LONG_COOLDOWN = {"failure_threshold": 1, "cooldown_secs": 60.0}


def circuit(router, url: str) -> str:
    return router.state.registry.get(url).circuit.state.value


def upstream_errors(router) -> float:
    """The legs the router saw fail, whatever the role and kind."""
    return sum(
        sample.value
        for family in router.state.metrics.registry.collect()
        if family.name == "pd_router_upstream_errors"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


async def open_circuit(router, http: httpx.AsyncClient, url: str) -> None:
    """Make ``url`` fail one request (500) and send requests until one met the failure (the
    policy may pick the other workers first; bounded), then wait for its circuit to open."""
    await fault(url, fail_next=1, fail_status=500)
    failed_before = upstream_errors(router)
    for n in range(50):
        await http.post("/generate", json=generate_body(f"fails {n}", TOKENS))
        if upstream_errors(router) > failed_before:
            await wait_until(lambda: circuit(router, url) == "open", 5.0, f"{url} circuit open")
            return
    raise AssertionError(f"no request met the failure of {url}")


async def burst(http: httpx.AsyncClient, count: int, tokens: int = TOKENS) -> list[int]:
    """Send ``count`` requests at once; their status codes."""
    replies = await asyncio.gather(
        *(http.post("/generate", json=generate_body(f"burst {n}", tokens)) for n in range(count))
    )
    return [reply.status_code for reply in replies]


async def test_burst_after_every_decode_circuit_opened_is_served(cluster_factory):
    # At speed 1 a request decodes for about 0.3 s: the whole burst arrives while the first
    # requests are still running on the workers.
    cluster = cluster_factory(prefill=2, decode=2, speed=1.0)
    decodes = cluster.decode_urls
    async with (
        running_router(
            cluster, health=NO_PROBES, circuit={"failure_threshold": 1, "cooldown_secs": 0.2}
        ) as router,
        router.client() as http,
    ):
        for url in decodes:
            cluster.kill(url)
        await http.post("/generate", json=generate_body("outage", TOKENS))
        await wait_until(
            lambda: {circuit(router, url) for url in decodes} == {"open"}, 5.0, "all open"
        )
        for url in decodes:
            await asyncio.to_thread(cluster.restart, url)
        await wait_until(
            lambda: {circuit(router, url) for url in decodes} == {"half_open"}, 5.0, "half-open"
        )
        statuses = await burst(http, BURST, tokens=32)
        assert statuses == [200] * BURST
        await wait_until(
            lambda: {circuit(router, url) for url in decodes} == {"closed"}, 5.0, "all closed"
        )


async def test_open_circuits_do_not_refuse_requests_when_no_other_worker_is_left(
    cluster_factory,
):
    cluster = cluster_factory(prefill=1, decode=1, speed=0.0)
    decode = cluster.decode_urls[0]
    async with (
        running_router(cluster, health=NO_PROBES, circuit=LONG_COOLDOWN) as router,
        router.client() as http,
    ):
        await fault(decode, fail_next=1, fail_status=500)
        assert (await http.post("/generate", json=generate_body("f", TOKENS))).status_code == 502
        await wait_until(lambda: circuit(router, decode) == "open", 5.0, "circuit open")
        assert (await http.post("/generate", json=generate_body("ok", TOKENS))).status_code == 200
        await wait_until(lambda: circuit(router, decode) == "closed", 5.0, "circuit closed")


async def test_open_circuit_still_steers_traffic_to_the_other_workers(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    broken, other = cluster.decode_urls
    async with (
        running_router(cluster, health=NO_PROBES, circuit=LONG_COOLDOWN) as router,
        router.client() as http,
    ):
        await open_circuit(router, http, broken)
        assert router.state.registry.selectable(Role.DECODE) == [router.state.registry.get(other)]
        assert await burst(http, 4) == [200] * 4
        assert circuit(router, broken) == "open"


async def test_worker_seen_recovering_by_the_probes_gets_its_circuit_closed(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    decode = cluster.decode_urls[0]
    async with (
        running_router(cluster, circuit=LONG_COOLDOWN) as router,
        router.client() as http,
    ):
        worker = router.state.registry.get(decode)
        await open_circuit(router, http, decode)
        await fault(decode, unhealthy=True)
        await wait_until(lambda: not worker.healthy, 5.0, "decode unhealthy")
        await fault(decode, unhealthy=False)
        await wait_until(lambda: worker.healthy, 5.0, "decode healthy again")
        assert circuit(router, decode) == "closed"
        metrics = (await http.get("/metrics")).text
        assert f'pd_router_circuit_state{{worker="{decode}"}} 0.0' in metrics


async def test_restarted_worker_gets_its_circuit_closed(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    decode = cluster.decode_urls[0]
    async with (
        running_router(cluster, health={"failure_threshold": 1000}, circuit=LONG_COOLDOWN) as r,
        r.client() as http,
    ):
        await open_circuit(r, http, decode)
        await asyncio.to_thread(cluster.restart, decode)
        await wait_until(lambda: circuit(r, decode) == "closed", 5.0, "restart seen")


async def test_restart_of_a_worker_without_extension_routes_is_seen_in_its_server_info(
    cluster_factory,
):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    decode = cluster.decode_urls[0]
    await fault(decode, native_only=True)
    async with (
        running_router(cluster, health={"failure_threshold": 1000}, circuit=LONG_COOLDOWN) as r,
        r.client() as http,
    ):
        assert r.state.registry.get(decode).has_extensions is False
        await open_circuit(r, http, decode)
        await asyncio.to_thread(cluster.restart, decode)
        await wait_until(lambda: circuit(r, decode) == "closed", 5.0, "restart seen")
