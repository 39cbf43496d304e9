"""A real Prometheus scraping a live router and its reference workers evaluates every Grafana
query and every alert rule without error, and the pool and role panels describe the live
cluster."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from dashboard_helpers import dashboard_queries, load_dashboard
from router_helpers import generate_body, running_router, wait_until

from pd_worker.cluster import WorkerCluster, free_port
from tests import model_clusters as two

yaml = pytest.importorskip("yaml", reason="PyYAML (test extra) writes the Prometheus config")

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        PROMETHEUS is None,
        reason="prometheus not installed (Debian: apt-get install --no-install-recommends "
        "prometheus)",
    ),
]

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RATE_INTERVAL = "10s"  # what Grafana puts in $__rate_interval at a 1 s scrape interval
ALL_MODELS = ".*"  # what Grafana puts in $model with All picked (the variable's allValue)
START_TIMEOUT_SECS = 30.0
MODEL = "toy"  # the one model the workers serve


def live_queries() -> Iterator[tuple[str, str]]:
    """Every dashboard query as Grafana sends it at a 1 s scrape interval, every model picked."""
    for where, expr in dashboard_queries(load_dashboard()):
        yield where, expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model", ALL_MODELS)


def prometheus_config(router: str, workers: list[str]) -> dict[str, Any]:
    """The shipped config's jobs, pointed at the live processes, scraping every second."""
    shipped = yaml.safe_load((CONFIGS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in shipped["scrape_configs"]}
    jobs["pd-router"]["static_configs"] = [{"targets": [router]}]
    jobs["pd-workers"]["static_configs"] = [{"targets": workers}]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(CONFIGS / "alerts.yml")],
        "scrape_configs": list(jobs.values()),
    }


def host_port(url: str) -> str:
    return url.split("//", 1)[1]


@pytest.fixture(scope="module")
def cluster(module_cluster_factory) -> WorkerCluster:
    return module_cluster_factory(prefill=2, decode=2, extra_args=("--served-model-name", MODEL))


@contextlib.asynccontextmanager
async def scraping(router: str, workers: list[str]) -> AsyncIterator[httpx.AsyncClient]:
    """Prometheus (its HTTP API) scraping the router and ``workers`` (urls), each target
    scraped twice already."""
    with tempfile.TemporaryDirectory(prefix="pd-router-prometheus-") as workdir:
        config = Path(workdir) / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(prometheus_config(host_port(router), [host_port(u) for u in workers]))
        )
        port = free_port()
        process = await asyncio.create_subprocess_exec(
            PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir}/data",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10.0) as api:
                await wait_for_scrapes(api, len(workers) + 1)
                yield api
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), 10.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prometheus(cluster: WorkerCluster) -> AsyncIterator[httpx.AsyncClient]:
    """Prometheus (its HTTP API) scraping a router that has served requests and, after
    Prometheus first saw it, converted a worker there and back (as in production, where the
    router runs under Prometheus before its first conversion)."""
    async with running_router(cluster) as router, router.client() as http:
        for i in range(4):
            assert (await http.post("/generate", json=generate_body(f"p {i}"))).status_code == 200
        async with scraping(router.url, cluster.urls) as api:
            for role in ("decode", "prefill"):
                body = {"server_url": cluster.prefill_urls[1], "new_role": role}
                response = await http.post("/convert_pd_role", json=body)
                assert response.status_code == 200, response.text
            await wait_for_conversions_scraped(api, 2)
            yield api


async def wait_for_scrapes(api: httpx.AsyncClient, targets: int) -> None:
    """Every target scraped at least twice (two points for every rate())."""

    async def scraped() -> bool:
        try:
            if (await api.get("/-/ready")).status_code != 200:
                return False
        except httpx.HTTPError:
            return False
        return len(await query(api, "count_over_time(up[1m]) >= 2")) == targets

    await wait_until(scraped, START_TIMEOUT_SECS, "Prometheus scraped every target twice")


async def wait_for_conversions_scraped(api: httpx.AsyncClient, count: int) -> None:
    async def scraped() -> bool:
        expr = 'sum(pd_router_conversions_total{outcome="succeeded"})'
        result = await query(api, expr)
        return bool(result) and float(result[0]["value"][1]) == count

    await wait_until(scraped, START_TIMEOUT_SECS, f"Prometheus scraped {count} conversions")


async def query(api: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    response = await api.get("/api/v1/query", params={"query": expr})
    body = response.json()
    if body["status"] != "success":
        raise AssertionError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


async def test_every_dashboard_query_evaluates_on_live_data(prometheus):
    failures = []
    for title, expr in live_queries():
        try:
            await query(prometheus, expr)
        except AssertionError as exc:
            failures.append(f"{title}: {exc}")
    assert failures == []


async def test_every_alert_rule_evaluates_without_error_and_none_fires(prometheus):
    started = time.time()

    async def evaluated_since_start() -> bool:
        groups = (await prometheus.get("/api/v1/rules")).json()["data"]["groups"]
        return all(g["lastEvaluation"] > time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(started))
                   for g in groups)  # fmt: skip

    await wait_until(evaluated_since_start, START_TIMEOUT_SECS, "rules evaluated again")
    groups = (await prometheus.get("/api/v1/rules")).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == len(
        [
            r
            for g in yaml.safe_load((CONFIGS / "alerts.yml").read_text())["groups"]
            for r in g["rules"]
        ]
    )
    for rule in rules:
        assert (rule["name"], rule["health"], rule.get("lastError", "")) == (rule["name"], "ok", "")
        assert rule["state"] == "inactive", rule["name"]


async def test_pool_size_panel_shows_two_prefill_and_two_decode(prometheus):
    (expr,) = [e for where, e in live_queries() if where.startswith("panel 'Pool sizes' ")]
    result = await query(prometheus, expr)
    assert {r["metric"]["role"]: float(r["value"][1]) for r in result} == {
        "prefill": 2.0,
        "decode": 2.0,
    }


async def test_pool_sizes_by_model_panel_shows_the_models_two_prefill_and_two_decode(prometheus):
    (expr,) = [e for where, e in live_queries() if where.startswith("panel 'Pool sizes by model' ")]
    result = await query(prometheus, expr)
    assert {(r["metric"]["model"], r["metric"]["role"]): float(r["value"][1]) for r in result} == {
        (MODEL, "prefill"): 2.0,
        (MODEL, "decode"): 2.0,
    }


async def test_model_variable_lists_the_model_the_workers_serve(prometheus):
    (expr,) = [e for where, e in live_queries() if where == "variable model"]
    result = await query(prometheus, expr)
    assert {r["metric"]["model"] for r in result} == {MODEL}


async def test_worker_role_panel_maps_each_worker_to_its_role(prometheus, cluster):
    (expr,) = [e for where, e in live_queries() if where.startswith("panel 'Worker role' ")]
    result = await query(prometheus, expr)
    roles = {r["metric"]["worker"]: float(r["value"][1]) for r in result}
    assert roles == {
        **{url: 1.0 for url in cluster.prefill_urls},
        **{url: 2.0 for url in cluster.decode_urls},
    }


async def test_conversion_annotation_marks_the_conversions_just_made(prometheus):
    (expr,) = [e for where, e in live_queries() if where == "annotation Conversions"]
    result = await query(prometheus, expr)
    directions = {(r["metric"]["from_role"], r["metric"]["to_role"]) for r in result}
    assert directions == {("prefill", "decode"), ("decode", "prefill")}
    assert {r["metric"]["outcome"] for r in result} == {"succeeded"}


async def test_per_model_panels_show_each_models_pools_on_a_two_model_router(
    module_cluster_factory,
):
    big, small = two.big_and_small(module_cluster_factory)
    async with (
        running_router(big, regular=two.regular_entries(small)) as router,
        scraping(router.url, big.urls + small.regular_urls) as api,
    ):
        await two.wait_for_models(router)

        async def every_model_scraped() -> bool:
            result = await query(api, "pd_router_worker_model")
            return {r["metric"].get("model") for r in result} == {two.BIG, two.SMALL}

        await wait_until(every_model_scraped, START_TIMEOUT_SECS, "both models scraped")
        panels = {where.split(" ", 1)[1]: expr for where, expr in live_queries()}
        pools = await query(api, panels["'Pool sizes by model' A"])
        inflight = await query(api, panels["'In flight by model' A"])
    assert {(r["metric"]["model"], r["metric"]["role"]): float(r["value"][1]) for r in pools} == {
        (two.BIG, "prefill"): 1.0,
        (two.BIG, "decode"): 2.0,
        (two.SMALL, "regular"): 2.0,
    }
    assert {(r["metric"]["model"], r["metric"]["role"]) for r in inflight} == set(
        two.models_and_roles(big, small).values()
    )
