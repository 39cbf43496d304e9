"""``GET /engine_metrics``: every worker's own Prometheus metrics in one exposition, each sample
labelled ``worker_addr`` with the worker's url, as sglang-router and smg serve it (one scrape
target for a whole PD deployment's ``sglang:*`` series).

The workers' texts are parsed and written again by prometheus-client, so a family that several
workers export comes out once, with one sample per worker.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pd_router.api.keys import REGISTRY, SESSION
from pd_router.control.worker_calls import CallReply, fan_out
from pd_router.errors import NoWorkers, UpstreamError

WORKER_LABEL = "worker_addr"
SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


class Families:
    """A collector that yields already-built families (what the workers exported)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


async def handle_engine_metrics(request: web.Request) -> web.Response:
    """The workers' /metrics merged; 503 with no worker, 502 when none answered."""
    registry = request.app[REGISTRY]
    workers = list(registry)
    if not workers:
        raise NoWorkers("no worker to read metrics from")
    replies = await fan_out(request.app[SESSION], workers, "GET", "/metrics", limit=SCRAPE_TIMEOUT)
    answered = [r for r in replies if r.ok]
    if not answered:
        raise UpstreamError("no worker answered GET /metrics")
    response = web.Response(body=merged_exposition(answered))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def merged_exposition(replies: list[CallReply]) -> bytes:
    """One text exposition of the replies' metrics, every sample labelled with its worker."""
    families: dict[str, Metric] = {}
    for reply in replies:
        text = reply.body.decode("utf-8", "replace")
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            merged.samples.extend(
                sample._replace(labels={**sample.labels, WORKER_LABEL: reply.worker.url})
                for sample in family.samples
            )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(families.values()))
    return generate_latest(registry)
