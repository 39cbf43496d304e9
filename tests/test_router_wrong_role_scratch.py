"""Scratch: the request path with the X-PD-Role header, 421 retried and suspect() called."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pd_router.workers import Role
from tests.router_helpers import assert_paired, generate_body, running_router

TOKENS = 4


@pytest.mark.parametrize(
    ("index", "body", "new_role"),
    [
        ("decode", {"new_role": "prefill"}, Role.PREFILL),
        ("prefill", {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.6}, Role.DECODE),
    ],
)
async def test_misrouted_legs_are_retried_at_once_and_the_worker_moved(
    cluster_factory, index, body, new_role
):
    cluster = cluster_factory(prefill=2, decode=2, speed=1.0)
    url = (cluster.decode_urls if index == "decode" else cluster.prefill_urls)[0]
    async with running_router(
        cluster, prefill_policy="round_robin", decode_policy="round_robin",
        health={"interval_secs": 60.0},
    ) as router:  # fmt: skip
        worker = router.state.registry.get(url)
        async with httpx.AsyncClient(timeout=10.0) as operator:
            assert (await operator.post(url + "/pd_role_switch", json=body)).json()["success"]
        async with router.client() as http:

            async def one(n: int) -> float:
                started = time.monotonic()
                prompt = f"misrouted {n}"
                response = await http.post("/generate", json=generate_body(prompt, TOKENS))
                assert response.status_code == 200, response.text
                assert_paired(response.json(), prompt, TOKENS)
                return time.monotonic() - started

            durations = await asyncio.gather(*(one(n) for n in range(8)))
        print("durations", sorted(round(d, 3) for d in durations))
        print("retries", router.state.metrics.registry.get_sample_value("pd_router_retries_total"))
        assert worker.role is new_role
        assert max(durations) < 5.0


async def test_second_router_conversion_with_no_probes_costs_no_request(cluster_factory):
    from tests.conversion_helpers import CheckedLoad, convert

    cluster = cluster_factory(prefill=2, decode=2, speed=1.0)
    moved = cluster.decode_urls[0]
    async with (
        running_router(
            cluster, health={"interval_secs": 60.0}, circuit={"cooldown_secs": 0.5}
        ) as unaware,
        running_router(cluster) as converting,
        converting.client() as admin,
    ):
        worker = unaware.state.registry.get(moved)
        async with CheckedLoad(unaware.url, concurrency=4, tokens=8) as load:
            await load.wait_for_requests(10)
            started = time.monotonic()
            response = await convert(admin, server_url=moved, new_role="prefill")
            assert response.json()["status"] == "succeeded", response.text
            from tests.router_helpers import wait_until

            await wait_until(lambda: worker.role is Role.PREFILL, 10.0, "moved")
            await load.wait_for_requests(load.result.ok + load.result.failed + 40)
        print("moved", worker.role, "after", round(time.monotonic() - started, 3))
        print(
            "errors",
            unaware.state.metrics.registry.get_sample_value(
                "pd_router_upstream_errors_total", {"role": "decode", "kind": "wrong_role"}
            ),
        )
        assert load.result.failed == 0, load.result.errors[:3]
        assert worker.role is Role.PREFILL
