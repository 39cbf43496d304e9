"""A leg that reaches a worker serving the other role (switched behind the router's back) is
answered 421 by the extension, retried on a new pair at once, and the worker is re-read and
moved, without waiting for a health probe or a KV hand-off timeout."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_router.control.workers import Role
from tests.conversion_helpers import converted_by_a_second_router
from tests.router_helpers import assert_paired, generate_body, running_router, wait_until

TOKENS = 4
NO_PROBES = {"interval_secs": 60.0}


def wrong_role_errors(router, role: Role) -> float:
    value = router.state.metrics.registry.get_sample_value(
        "pd_router_upstream_errors_total", {"role": role.value, "kind": "wrong_role"}
    )
    return value or 0.0


@pytest.mark.parametrize(
    ("pool", "switch_body", "new_role"),
    [
        (Role.DECODE, {"new_role": "prefill"}, Role.PREFILL),
        (Role.PREFILL, {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.6}, Role.DECODE),
    ],
)
async def test_leg_to_a_worker_switched_behind_the_router_is_retried_and_the_worker_moved(
    cluster_factory, pool, switch_body, new_role
):
    cluster = cluster_factory(prefill=2, decode=2, speed=1.0)
    url = (cluster.decode_urls if pool is Role.DECODE else cluster.prefill_urls)[0]
    async with running_router(
        cluster, prefill_policy="round_robin", decode_policy="round_robin", health=NO_PROBES
    ) as router:
        worker = router.state.registry.get(url)
        async with httpx.AsyncClient(timeout=10.0) as operator:
            switched = await operator.post(url + "/pd_role_switch", json=switch_body)
            assert switched.json()["success"], switched.text
        # Shorter than the 30 s KV hand-off timeout a misrouted leg used to wait for.
        async with router.client(timeout=10.0) as http:

            async def one(n: int) -> None:
                prompt = f"misrouted {n}"
                response = await http.post("/generate", json=generate_body(prompt, TOKENS))
                assert response.status_code == 200, response.text
                assert_paired(response.json(), prompt, TOKENS)

            await asyncio.gather(*(one(n) for n in range(8)))
        assert wrong_role_errors(router, pool) >= 1
        await wait_until(lambda: worker.role is new_role, 5.0, "misrouted worker moved")


async def test_a_second_routers_conversion_costs_an_unaware_router_no_request(cluster_factory):
    cluster = cluster_factory(prefill=2, decode=2, speed=1.0)
    async with converted_by_a_second_router(
        cluster, cluster.decode_urls[0], within=10.0,
        health=NO_PROBES, circuit={"cooldown_secs": 0.5},
    ) as (_, load):  # fmt: skip
        assert load.failed == 0, load.errors[:3]
