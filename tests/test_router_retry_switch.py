"""``[retry] enabled = false`` and ``[circuit] enabled = false`` on the request path, through a
real router and reference workers with injected faults."""

from __future__ import annotations

import pytest

from tests.router_helpers import fault, generate_body, running_router


@pytest.fixture(autouse=True)
async def clear_faults(pd_cluster):
    yield
    for url in pd_cluster.urls:
        await fault(url, clear=True)


def retries(router) -> float:
    return router.state.metrics.registry.get_sample_value("pd_router_retries_total") or 0.0


async def test_with_retries_off_a_503_reaches_the_client_after_one_attempt(pd_cluster):
    await fault(pd_cluster.prefill_urls[0], fail_next=1, fail_status=503)
    config = {"retry": {"enabled": False, "max_attempts": 5}}
    async with running_router(pd_cluster, **config) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("once", 2))
        assert response.status_code == 503
        assert retries(router) == 0
        assert (await http.post("/generate", json=generate_body("again", 2))).status_code == 200


async def test_with_the_circuit_off_failures_never_open_it(pd_cluster):
    decode = pd_cluster.decode_urls[0]
    await fault(decode, fail_next=3, fail_status=500)
    config = {"circuit": {"enabled": False, "failure_threshold": 1}, "retry": {"enabled": False}}
    async with running_router(pd_cluster, **config) as router, router.client() as http:
        for _ in range(3):
            response = await http.post("/generate", json=generate_body("fails", 2))
            assert response.status_code == 502
        assert router.state.registry.get(decode).circuit.state.value == "closed"
        assert (await http.post("/generate", json=generate_body("served", 2))).status_code == 200
