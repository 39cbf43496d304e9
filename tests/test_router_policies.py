"""Selection policies: each one's choice on real Worker objects, and the same behaviour seen
through the router (the decode's ``kv_source`` names the prefill that served a request)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pd_router.config import SECTIONS
from pd_router.control.workers import Role, WorkerRegistry
from pd_router.dataplane.path.proxy import SSE_HEADERS
from pd_router.dataplane.routing.policies import (
    POLICIES,
    POLICY_ALIASES,
    LeastInflightPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    canonical_policy_name,
    make_policy,
)
from pd_router.metrics import RouterMetrics
from tests.router_helpers import assert_paired, generate_body, running_router

TOKENS = 2


@pytest.fixture
def registry() -> WorkerRegistry:
    registry = WorkerRegistry(RouterMetrics())
    for port in (1001, 1002, 1003):
        registry.add(f"http://127.0.0.1:{port}", Role.DECODE)
    return registry


def test_round_robin_takes_each_worker_in_turn(registry):
    workers = registry.selectable(Role.DECODE)
    policy = RoundRobinPolicy()
    picks = [policy.select(workers).url for _ in range(6)]
    assert picks == [w.url for w in workers] * 2


def test_least_inflight_never_picks_the_busier_of_two(registry):
    a, b, _ = registry.selectable(Role.DECODE)
    a.inflight = 1
    policy = LeastInflightPolicy(random.Random(7))
    assert {policy.select([a, b]).url for _ in range(20)} == {b.url}


def test_least_inflight_avoids_the_most_loaded_of_three(registry):
    workers = registry.selectable(Role.DECODE)
    workers[0].inflight = 5
    policy = LeastInflightPolicy(random.Random(3))
    picks = Counter(policy.select(workers).url for _ in range(300))
    assert workers[0].url not in picks
    assert set(picks) == {workers[1].url, workers[2].url}


def test_random_spreads_over_every_worker(registry):
    workers = registry.selectable(Role.DECODE)
    policy = RandomPolicy(random.Random(1))
    picks = Counter(policy.select(workers).url for _ in range(300))
    assert set(picks) == {w.url for w in workers}
    assert min(picks.values()) > 50


def test_mini_lb_policy_names_are_accepted():
    assert canonical_policy_name("power_of_two") == "power_of_two"
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(KeyError):
        canonical_policy_name("fastest")


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=1, speed=0.0)


async def served_by(http, prompt: str) -> str:
    response = await http.post("/generate", json=generate_body(prompt, TOKENS))
    return assert_paired(response.json(), prompt, TOKENS)


async def test_round_robin_alternates_prefills_through_the_router(cluster):
    async with (
        running_router(cluster, prefill_policy="round_robin") as router,
        router.client() as http,
    ):
        sources = [await served_by(http, f"rr {i}") for i in range(4)]
    assert sources[0] != sources[1]
    assert sources[:2] == sources[2:]


async def test_least_inflight_sends_traffic_to_the_idle_prefill(cluster):
    async with running_router(cluster, policy="least_inflight") as router:
        pools = router.dataplane.pools
        busy = pools.member(cluster.prefill_urls[0])
        pools.acquire(busy)
        async with router.client() as http:
            sources = {await served_by(http, f"li {i}") for i in range(10)}
        pools.release(busy)
    assert sources == {cluster.prefill_urls[1]}


async def test_random_reaches_both_prefills_through_the_router(cluster):
    async with running_router(cluster, policy="random") as router, router.client() as http:
        sources = {await served_by(http, f"rnd {i}") for i in range(30)}
    assert sources == set(cluster.prefill_urls)


@pytest.mark.parametrize("table", [POLICIES, POLICY_ALIASES, SECTIONS, SSE_HEADERS])
def test_module_level_tables_are_read_only(table):
    with pytest.raises(TypeError):
        table["injected"] = None
