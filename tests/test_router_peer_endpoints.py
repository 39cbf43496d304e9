"""The endpoints sglang-router and smg serve that clients call on a PD router, against real
reference workers: ``GET /v1/models/{id}`` (OpenAI's model object, 404 ``model_not_found`` in
OpenAI's error shape), ``/liveness``, ``/get_loads`` (every worker's load in tokens, as the
peers aggregate the workers' ``/get_load``), ``/engine_metrics`` (the workers' own metrics,
labelled with their url) and ``GET /workers/{id-or-url}``."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_worker.cluster import free_port
from tests.router_helpers import generate_body, running_router, wait_until

MODEL = "org/model-7b"  # an id with a slash, as Hugging Face names are
SLOW_TOKENS = 300  # about 3 s of decoding at speed 1: a request still in flight when read
KEY = "peer-endpoints-admin-key"


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(
        prefill=1, decode=1, speed=0.0, extra_args=("--served-model-name", MODEL)
    )


@pytest.fixture
def slow_cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=1, speed=1.0)


async def test_v1_models_id_answers_the_model_object_of_a_served_model(cluster):
    async with running_router(cluster) as router, router.client() as http:
        response = await http.get(f"/v1/models/{MODEL}")
        listed = (await http.get("/v1/models")).json()["data"]
    assert response.status_code == 200
    model = response.json()
    assert model == next(m for m in listed if m["id"] == MODEL)
    assert (model["id"], model["object"]) == (MODEL, "model")


async def test_v1_models_id_answers_404_model_not_found_for_an_unknown_model(cluster):
    async with running_router(cluster) as router, router.client() as http:
        response = await http.get("/v1/models/org/no-such-model")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["message"] == "The model 'org/no-such-model' does not exist"
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "model", "model_not_found",
    )  # fmt: skip


async def test_liveness_answers_200_while_the_router_serves(cluster):
    async with running_router(cluster) as router, router.client() as http:
        response = await http.get("/liveness")
    assert response.status_code == 200


async def test_get_loads_lists_every_worker_with_its_role_and_load(cluster):
    mistyped = f"http://127.0.0.1:{free_port()}"
    decode = [*cluster.decode_urls, mistyped]
    async with running_router(cluster, decode=decode) as router, router.client() as http:
        response = await http.get("/get_loads")
    assert response.status_code == 200
    entries = {entry["worker"]: entry for entry in response.json()["workers"]}
    assert set(entries) == {*cluster.urls, mistyped}
    for url in cluster.prefill_urls:
        assert (entries[url]["worker_type"], entries[url]["load"]) == ("prefill", 0)
    for url in cluster.decode_urls:
        assert (entries[url]["worker_type"], entries[url]["load"]) == ("decode", 0)
    assert entries[mistyped]["load"] == -1


async def test_get_loads_counts_the_tokens_of_a_request_in_flight(slow_cluster):
    decode = slow_cluster.decode_urls[0]

    async def decode_load(http) -> int:
        workers = (await http.get("/get_loads")).json()["workers"]
        return next(entry["load"] for entry in workers if entry["worker"] == decode)

    async with running_router(slow_cluster) as router, router.client() as http:
        request = asyncio.create_task(
            http.post("/generate", json=generate_body("busy " * 40, SLOW_TOKENS))
        )
        try:
            loads: list[int] = []

            async def loaded() -> bool:
                loads.append(await decode_load(http))
                return loads[-1] > 0

            await wait_until(loaded, 10.0, "decode load above 0")
        finally:
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request


async def test_get_loads_needs_the_admin_key_when_one_is_set(cluster):
    async with running_router(cluster, admin_api_key=KEY) as router, router.client() as http:
        refused = await http.get("/get_loads")
        allowed = await http.get("/get_loads", headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 401
    assert allowed.status_code == 200


async def test_get_workers_by_id_or_url_answers_that_worker_and_404_for_an_unknown_one(cluster):
    decode = cluster.decode_urls[0]
    async with running_router(cluster) as router, router.client() as http:
        worker_id = router.state.registry.get(decode).id
        by_id = await http.get(f"/workers/{worker_id}")
        by_url = await http.get(f"/workers/{decode}")
        unknown = await http.get("/workers/w999")
    assert by_id.status_code == by_url.status_code == 200
    assert by_id.json()["url"] == by_url.json()["url"] == decode
    assert by_id.json()["role"] == "decode"
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found"


def samples_by_worker(text: str, name: str) -> dict[str, float]:
    """``name``'s samples of an exposition, by their ``worker_addr`` label."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[sample.labels["worker_addr"]] = sample.value
    return found


async def test_engine_metrics_merges_every_workers_metrics_labelled_with_its_url(cluster):
    mistyped = f"http://127.0.0.1:{free_port()}"
    decode = [*cluster.decode_urls, mistyped]
    async with running_router(cluster, decode=decode) as router, router.client() as http:
        response = await http.get("/engine_metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    running = samples_by_worker(response.text, "sglang:num_running_reqs")
    assert set(running) == set(cluster.urls)
    assert response.text.count("# TYPE sglang:num_running_reqs ") == 1


async def test_engine_metrics_answers_502_when_no_worker_answers():
    async with (
        running_router(prefill=[f"http://127.0.0.1:{free_port()}"],
                       decode=[f"http://127.0.0.1:{free_port()}"]) as router,
        router.client() as http,
    ):  # fmt: skip
        response = await http.get("/engine_metrics")
    assert response.status_code == 502
    assert response.json()["error"]["type"] == "upstream_error"
