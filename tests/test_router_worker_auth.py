"""Workers launched with SGLang's ``--api-key``: the router sends ``Authorization: Bearer`` on
every call to them (request legs, probes, fan-outs, aborts, worker control)."""

from __future__ import annotations

import httpx
import pytest

from pd_router.cli.main import config_from_argv
from pd_router.control.workers import Role
from pd_worker.cluster import WorkerCluster
from tests.router_helpers import assert_paired, generate_body, running_router, sse_events

KEY = "worker-secret"
TOKENS = 3


@pytest.fixture(scope="module")
def cluster():
    with WorkerCluster(prefill=1, decode=1, speed=0.0, extra_args=("--api-key", KEY)) as c:
        yield c


@pytest.fixture
async def router(cluster):
    async with running_router(
        cluster, worker_api_key=KEY, conversion={"min_prefill": 0, "min_decode": 0}
    ) as r:
        yield r


@pytest.fixture
async def http(router):
    async with router.client() as client:
        yield client


async def test_worker_rejects_calls_without_the_key(cluster):
    async with httpx.AsyncClient(timeout=5.0) as plain:
        response = await plain.get(cluster.prefill_urls[0] + "/server_info")
    assert response.status_code == 401


async def test_router_without_the_key_keeps_such_workers_out_of_the_pools(cluster):
    async with running_router(cluster) as router, router.client() as http:
        assert (await http.get("/readiness")).status_code == 503
        refused = await http.post("/generate", json=generate_body("x", TOKENS))
        assert refused.status_code == 503


async def test_probes_read_role_and_bootstrap_port_with_the_key(router, cluster):
    prefill = router.state.registry.get(cluster.prefill_urls[0])
    assert prefill.healthy
    assert prefill.bootstrap_port == cluster.bootstrap_port(prefill.url)


async def test_request_legs_carry_the_key(http):
    response = await http.post("/generate", json=generate_body("keyed", TOKENS))
    assert response.status_code == 200
    assert_paired(response.json(), "keyed", TOKENS)


async def test_streamed_legs_carry_the_key(http):
    response = await http.post("/generate", json=generate_body("keyed", TOKENS, stream=True))
    assert sse_events(response.text)[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/flush_cache", None),
        ("POST", "/abort_request", {"rid": "nothing"}),
    ],
)
async def test_fan_outs_carry_the_key(http, method, path, body):
    response = await http.request(method, path, json=body)
    assert response.status_code == 200
    assert [w["status"] for w in response.json()["workers"]] == [200, 200]


async def test_worker_info_is_read_with_the_key(http):
    assert (await http.get("/server_info")).status_code == 200
    assert (await http.get("/v1/models")).status_code == 200


async def test_conversion_control_calls_carry_the_key(router, http, cluster):
    url = cluster.prefill_urls[0]
    converted = await http.post(
        "/convert_pd_role", json={"server_url": url, "new_role": "decode"}, timeout=30.0
    )
    assert converted.status_code == 200, converted.text
    assert router.state.registry.get(url).role is Role.DECODE
    back = await http.post(
        "/convert_pd_role", json={"server_url": url, "new_role": "prefill"}, timeout=30.0
    )
    assert back.status_code == 200, back.text
    assert router.state.registry.get(url).role is Role.PREFILL


def test_api_key_flag_and_environment_set_the_worker_key(monkeypatch):
    workers = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert config_from_argv([*workers, "--api-key", "k1"]).worker_api_key == "k1"
    assert config_from_argv([*workers, "--worker-api-key", "k2"]).worker_api_key == "k2"
    monkeypatch.setenv("PD_ROUTER_WORKER_API_KEY", "k3")
    config = config_from_argv(workers)
    assert config.worker_api_key == "k3"
    assert "k3" not in repr(config)
