"""Every metric name in the Grafana dashboard and the alert rules is one that a live router or
a live reference worker (SGLang's ``sglang:`` names) really exports, after traffic, a failed
upstream leg and a conversion have given every counter and histogram its series."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from dashboard_helpers import dashboard_queries, load_dashboard
from router_helpers import fault, generate_body, running_router, wait_until

yaml = pytest.importorskip("yaml", reason="PyYAML (test extra) parses the alert rules")

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ALERTS = CONFIGS / "alerts.yml"

PROMQL_WORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
     "group_right", "inf", "nan"}
)  # fmt: skip
IDENTIFIER = re.compile(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label names and
    matchers, durations and grouping clauses left out)."""
    text = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in IDENTIFIER.finditer(text):
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or match.group() in PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def sample_names(exposition: str) -> set[str]:
    """Names of the samples in a Prometheus text exposition."""
    return {
        IDENTIFIER.match(line).group()
        for line in exposition.splitlines()
        if line and not line.startswith("#")
    }


def families_with_samples(exposition: str) -> set[str]:
    """Metric families (``# TYPE`` names) that have at least one sample."""
    samples = sample_names(exposition)
    families = {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE ")}
    return {
        family
        for family in families
        if not family.endswith("_created")
        and any(s == family or s.startswith(family + "_") for s in samples)
    }


def alert_queries() -> Iterator[tuple[str, str]]:
    with open(ALERTS) as f:
        groups = yaml.safe_load(f)["groups"]
    for group in groups:
        for rule in group["rules"]:
            yield f"alert {rule['alert']}", rule["expr"]


@dataclass(frozen=True)
class Exported:
    router: str
    worker: str

    @property
    def names(self) -> set[str]:
        return sample_names(self.router) | sample_names(self.worker)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def exported(module_cluster_factory) -> Exported:
    """/metrics of a router and a worker after requests (streamed and not), a failed prefill
    leg that was retried, a prefill -> decode conversion and autopilot decisions."""
    cluster = module_cluster_factory(prefill=2, decode=2)
    autopilot = {"mode": "recommend", "interval_secs": 0.05, "window_secs": 0.05}
    async with running_router(cluster, autopilot=autopilot) as router, router.client() as http:
        for i in range(4):
            response = await http.post("/generate", json=generate_body(f"plain {i}"))
            assert response.status_code == 200
        response = await http.post("/generate", json=generate_body("streamed", stream=True))
        assert response.status_code == 200
        for url in cluster.prefill_urls:
            await fault(url, fail_next=1, fail_status=503)
        response = await http.post("/generate", json=generate_body("after a failed leg"))
        assert response.status_code == 200
        convert = {"server_url": cluster.prefill_urls[1], "new_role": "decode"}
        response = await http.post("/convert_pd_role", json=convert)
        assert response.status_code == 200, response.text
        await wait_until(
            lambda: router.state.autopilot.last_decision is not None, what="an autopilot decision"
        )
        router_text = (await http.get("/metrics")).text
    async with httpx.AsyncClient(timeout=10.0) as client:
        worker_text = (await client.get(cluster.decode_urls[0] + "/metrics")).text
    return Exported(router_text, worker_text)


def unknown_names(queries: Iterator[tuple[str, str]], exported: Exported) -> list[str]:
    problems = []
    for where, expr in queries:
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: no metric name found in {expr!r}")
        for name in sorted(names - exported.names):
            problems.append(f"{where}: {name} is not exported")
    return problems


async def test_traffic_gave_every_router_counter_and_histogram_a_series(exported):
    names = sample_names(exported.router)
    for name in (
        "pd_router_requests_total",
        "pd_router_ttft_seconds_bucket",
        "pd_router_upstream_errors_total",
        "pd_router_conversions_total",
        "pd_router_conversion_phase_seconds_bucket",
    ):
        assert name in names


async def test_every_grafana_query_uses_metrics_a_live_router_or_worker_exports(exported):
    assert unknown_names(dashboard_queries(load_dashboard()), exported) == []


async def test_every_alert_rule_uses_metrics_a_live_router_or_worker_exports(exported):
    assert unknown_names(alert_queries(), exported) == []


async def test_dashboard_shows_every_router_metric_that_has_data(exported):
    used = {name for _, expr in dashboard_queries(load_dashboard()) for name in metric_names(expr)}
    used_families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    missing = families_with_samples(exported.router) - used_families
    assert missing == set()


async def test_dashboard_shows_sglang_worker_metrics(exported):
    used = {name for _, expr in dashboard_queries(load_dashboard()) for name in metric_names(expr)}
    worker_names = sample_names(exported.worker)
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"} <= (
        used & worker_names
    )
