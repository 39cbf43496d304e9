"""``GET /metrics``: SGLang's ``sglang:`` gauges and counters, read from the engine when scraped,
and with ``--etcd`` how the worker's self-registration fares (``pd_worker_registered``,
``pd_worker_registration_lapses_total``, ``pd_worker_unregistered_seconds_total``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd_protocol.registration import RegistrationStats
from pd_worker.engine import Engine

LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank")


class EngineCollector(Collector):
    """Builds every metric family from the engine's live state (no module-level registry)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def _labels(self) -> list[str]:
        return [self._engine.config.model_name, "unified", "0", "0"]

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        loads = engine.loads()
        disagg = loads["disaggregation"]
        gauges = {
            "num_running_reqs": loads["num_running_reqs"],
            "num_queue_reqs": loads["num_waiting_reqs"],
            "num_used_tokens": loads["num_used_tokens"],
            "max_total_num_tokens": loads["max_total_num_tokens"],
            "token_usage": loads["token_usage"],
            "gen_throughput": loads["gen_throughput"],
            "cache_hit_rate": loads["cache_hit_rate"],
            "utilization": loads["utilization"],
            "num_prefill_prealloc_queue_reqs": disagg["prefill_bootstrap_queue_reqs"],
            "num_prefill_inflight_queue_reqs": disagg["prefill_inflight_queue_reqs"],
            "num_decode_prealloc_queue_reqs": disagg["decode_prealloc_queue_reqs"],
            "num_decode_transfer_queue_reqs": disagg["decode_transfer_queue_reqs"],
            "kv_transfer_speed_gb_s": disagg["kv_transfer_speed_gb_s"],
            "is_prefill": 1 if engine.role_name == "prefill" else 0,
        }
        for name, value in gauges.items():
            family = GaugeMetricFamily(f"sglang:{name}", f"SGLang {name}", labels=LABELS)
            family.add_metric(self._labels(), float(value))
            yield family
        stats = engine.stats
        counters = {
            "num_requests": stats.num_requests,
            "num_aborted_requests": stats.num_aborted_requests,
            "num_bootstrap_failed_reqs": stats.num_bootstrap_failed_reqs,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "generation_tokens": stats.generation_tokens,
        }
        for name, value in counters.items():
            counter = CounterMetricFamily(f"sglang:{name}", f"SGLang {name}", labels=LABELS)
            counter.add_metric(self._labels(), float(value))
            yield counter


class RegistrationCollector(Collector):
    """The worker's etcd self-registration, read from it when scraped."""

    def __init__(self, stats: Callable[[], RegistrationStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield GaugeMetricFamily(
            "pd_worker_registered",
            "1 while the worker's etcd registration holds (its lease renewed within its TTL).",
            value=1.0 if stats.registered else 0.0,
        )
        yield CounterMetricFamily(
            "pd_worker_registration_lapses",
            "Times the worker's etcd lease expired, or may have, before it was renewed.",
            value=float(stats.lapses),
        )
        yield CounterMetricFamily(
            "pd_worker_unregistered_seconds",
            "Seconds the worker served without an etcd registration (from the moment its lease "
            "could have expired, or its start, to its record being put again).",
            value=stats.unregistered_secs,
        )


def build_registry(engine: Engine) -> CollectorRegistry:
    """A registry holding only this engine's collector (one per worker app)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition."""
    return generate_latest(registry)
