"""The alert rules in configs/alerts.yml fire on the situations they name and stay quiet
otherwise, evaluated by Prometheus' own engine (``promtool test rules``) on synthetic series
shaped like the router's metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML (test extra) parses the rule file")

ALERTS = Path(__file__).resolve().parent.parent / "configs" / "alerts.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (Debian: apt-get install --no-install-recommends prometheus)",
)

ROUTER = 'instance="router:8000", job="pd-router"'
P0, P1 = "http://prefill-0:30000", "http://prefill-1:30000"
D0 = "http://decode-0:30000"


def rules() -> dict[str, dict]:
    with open(ALERTS) as f:
        groups = yaml.safe_load(f)["groups"]
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


def series(metric: str, values: str, **labels: str) -> dict:
    """One input series of the router's job with ``labels``; ``values`` in promtool notation."""
    extra = "".join(f', {k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{ROUTER}{extra}}}", "values": values}


def worker_series(url: str, role: str, *, healthy: int = 1, state: str = "active") -> list[dict]:
    """The series the registry exports for one worker, constant over the test."""
    return [
        series("pd_router_worker_healthy", f"{healthy}x20", worker=url),
        series("pd_router_worker_inflight", "0x20", worker=url, role=role),
        *(
            series("pd_router_worker_state", f"{int(name == state)}x20", worker=url, state=name)
            for name in ("active", "draining", "switching", "failed", "removing")
        ),
    ]


def pool_series(prefill: int, decode: int) -> list[dict]:
    return [
        series("pd_router_pool_size", f"{prefill}x20", role="prefill"),
        series("pd_router_pool_size", f"{decode}x20", role="decode"),
    ]


def fires_for(alert: str, series: list[dict], label_sets: list[str], tmp_path: Path) -> None:
    """Evaluate ``alert``'s expression at 4m on ``series`` (1m steps): it must return exactly
    ``label_sets`` (each ``{a="b", ...}``), whatever the values."""
    expected = [{"labels": labels, "value": 1} for labels in label_sets]
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {
                        "expr": f"({rules()[alert]['expr']}) * 0 + 1",
                        "eval_time": "4m",
                        "exp_samples": expected,
                    }
                ],
            }
        ],
    }
    path = tmp_path / "alerts_test.yml"
    path.write_text(json.dumps(test))
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_file_defines_every_alert_an_operator_needs():
    assert {
        "PDRouterNoHealthyPrefill",
        "PDRouterNoHealthyDecode",
        "PDRouterWorkerFailed",
        "PDRouterConversionStuckDraining",
        "PDRouterHighErrorRatio",
        "PDRouterCircuitOpen",
        "PDRouterTTFTP99High",
        "PDRouterEtcdUnreachable",
    } <= set(rules())


def test_every_alert_has_a_severity_and_a_summary():
    for name, rule in rules().items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name


@needs_promtool
def test_promtool_accepts_the_rules_file():
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_no_healthy_prefill_fires_when_every_prefill_is_unhealthy(tmp_path):
    inputs = [
        *pool_series(2, 1),
        *worker_series(P0, "prefill", healthy=0),
        *worker_series(P1, "prefill", healthy=0),
        *worker_series(D0, "decode"),
    ]
    fires_for("PDRouterNoHealthyPrefill", inputs, ['{instance="router:8000"}'], tmp_path)


@needs_promtool
def test_no_healthy_prefill_fires_when_the_only_healthy_prefill_is_draining(tmp_path):
    inputs = [
        *pool_series(1, 1),
        *worker_series(P0, "prefill", healthy=0),
        *worker_series(P1, "prefill", state="draining"),
        *worker_series(D0, "decode"),
    ]
    fires_for("PDRouterNoHealthyPrefill", inputs, ['{instance="router:8000"}'], tmp_path)


@needs_promtool
def test_no_healthy_prefill_fires_when_the_prefill_pool_is_empty(tmp_path):
    inputs = [*pool_series(0, 1), *worker_series(D0, "decode")]
    fires_for("PDRouterNoHealthyPrefill", inputs, ['{instance="router:8000"}'], tmp_path)


@needs_promtool
def test_no_healthy_prefill_is_quiet_with_one_healthy_active_prefill(tmp_path):
    inputs = [
        *pool_series(2, 1),
        *worker_series(P0, "prefill", healthy=0),
        *worker_series(P1, "prefill"),
        *worker_series(D0, "decode"),
    ]
    fires_for("PDRouterNoHealthyPrefill", inputs, [], tmp_path)


@needs_promtool
def test_no_healthy_decode_fires_when_the_decode_is_unhealthy_and_prefills_are_fine(tmp_path):
    inputs = [
        *pool_series(2, 1),
        *worker_series(P0, "prefill"),
        *worker_series(P1, "prefill"),
        *worker_series(D0, "decode", healthy=0),
    ]
    fires_for("PDRouterNoHealthyDecode", inputs, ['{instance="router:8000"}'], tmp_path)


@needs_promtool
def test_worker_failed_names_the_failed_worker(tmp_path):
    inputs = [*worker_series(P0, "prefill", state="failed"), *worker_series(D0, "decode")]
    labels = f'{{{ROUTER}, worker="{P0}", state="failed"}}'
    fires_for("PDRouterWorkerFailed", inputs, [labels], tmp_path)


@needs_promtool
def test_stuck_draining_matches_only_the_draining_worker(tmp_path):
    inputs = [*worker_series(P0, "prefill", state="draining"), *worker_series(P1, "prefill")]
    labels = f'{{{ROUTER}, worker="{P0}", state="draining"}}'
    fires_for("PDRouterConversionStuckDraining", inputs, [labels], tmp_path)


@needs_promtool
def test_high_error_ratio_fires_at_ten_percent_5xx(tmp_path):
    inputs = [
        series("pd_router_requests_total", "0+90x10", endpoint="generate", status="200"),
        series("pd_router_requests_total", "0+10x10", endpoint="generate", status="503"),
    ]
    fires_for("PDRouterHighErrorRatio", inputs, ['{instance="router:8000"}'], tmp_path)


@needs_promtool
def test_high_error_ratio_is_quiet_at_one_percent_5xx_and_ignores_4xx(tmp_path):
    inputs = [
        series("pd_router_requests_total", "0+90x10", endpoint="generate", status="200"),
        series("pd_router_requests_total", "0+9x10", endpoint="generate", status="400"),
        series("pd_router_requests_total", "0+1x10", endpoint="generate", status="502"),
    ]
    fires_for("PDRouterHighErrorRatio", inputs, [], tmp_path)


@needs_promtool
def test_circuit_open_fires_for_open_but_not_half_open(tmp_path):
    inputs = [
        series("pd_router_circuit_state", "1x10", worker=P0),
        series("pd_router_circuit_state", "2x10", worker=P1),
        series("pd_router_circuit_state", "0x10", worker=D0),
    ]
    labels = f'{{{ROUTER}, worker="{P0}"}}'
    fires_for("PDRouterCircuitOpen", inputs, [labels], tmp_path)


@needs_promtool
def test_ttft_p99_fires_when_a_tenth_of_first_bytes_take_five_seconds(tmp_path):
    buckets = {"0.5": 90, "2.5": 90, "5.0": 100, "+Inf": 100}
    inputs = [
        series("pd_router_ttft_seconds_bucket", f"0+{count}x10", le=le)
        for le, count in buckets.items()
    ]
    fires_for("PDRouterTTFTP99High", inputs, ['{instance="router:8000"}'], tmp_path)


@needs_promtool
def test_ttft_p99_is_quiet_when_first_bytes_come_within_half_a_second(tmp_path):
    buckets = {"0.5": 100, "2.5": 100, "5.0": 100, "+Inf": 100}
    inputs = [
        series("pd_router_ttft_seconds_bucket", f"0+{count}x10", le=le)
        for le, count in buckets.items()
    ]
    fires_for("PDRouterTTFTP99High", inputs, [], tmp_path)


@needs_promtool
def test_conversions_failing_counts_rollbacks_but_not_successes_or_aborts(tmp_path):
    def conversions(outcome: str, values: str) -> dict:
        return series(
            "pd_router_conversions_total", values, from_role="prefill", to_role="decode",
            outcome=outcome,
        )  # fmt: skip

    inputs = [
        conversions("succeeded", "0+1x10"),
        conversions("aborted", "0+1x10"),
        conversions("restored", "0 0 0 1 1 1 1 1 1 1"),
    ]
    labels = '{instance="router:8000", from_role="prefill", to_role="decode"}'
    fires_for("PDRouterConversionsFailing", inputs, [labels], tmp_path)


@needs_promtool
def test_conversions_failing_fires_on_the_first_failure_after_the_series_was_exported_at_zero(
    tmp_path,
):
    inputs = [
        series(
            "pd_router_conversions_total", "0 0 0 1 1 1 1 1 1 1", from_role="decode",
            to_role="prefill", outcome="failed",
        ),
    ]  # fmt: skip
    labels = '{instance="router:8000", from_role="decode", to_role="prefill"}'
    fires_for("PDRouterConversionsFailing", inputs, [labels], tmp_path)


@needs_promtool
def test_upstream_errors_fires_per_role_and_kind_when_a_decode_keeps_failing(tmp_path):
    inputs = [
        series("pd_router_upstream_errors_total", "0+120x10", role="decode", kind="http_5xx"),
        series("pd_router_upstream_errors_total", "0+1x10", role="prefill", kind="connect"),
    ]
    labels = '{instance="router:8000", role="decode", kind="http_5xx"}'
    fires_for("PDRouterUpstreamErrors", inputs, [labels], tmp_path)


@needs_promtool
def test_upstream_errors_fires_when_workers_refuse_the_router_with_a_4xx(tmp_path):
    inputs = [
        series("pd_router_upstream_errors_total", "0+120x10", role="prefill", kind="http_4xx"),
    ]
    labels = '{instance="router:8000", role="prefill", kind="http_4xx"}'
    fires_for("PDRouterUpstreamErrors", inputs, [labels], tmp_path)


@needs_promtool
def test_upstream_errors_is_quiet_when_one_client_sends_only_invalid_requests(tmp_path):
    """What the router exports for a client sending 2 invalid requests a second: 400s in
    requests_total, no upstream error."""
    inputs = [
        series("pd_router_requests_total", "0+60x10", endpoint="/generate", status="200"),
        series("pd_router_requests_total", "0+120x10", endpoint="/generate", status="400"),
        series("pd_router_upstream_errors_total", "0x10", role="decode", kind="http_5xx"),
    ]
    fires_for("PDRouterUpstreamErrors", inputs, [], tmp_path)
    fires_for("PDRouterHighErrorRatio", inputs, [], tmp_path)


@needs_promtool
def test_etcd_unreachable_fires_for_a_replica_that_lost_etcd(tmp_path):
    inputs = [
        series("pd_router_cluster_etcd_up", "0x10"),
        series("pd_router_cluster_replicas", "2x10"),
    ]
    fires_for("PDRouterEtcdUnreachable", inputs, [f"{{{ROUTER}}}"], tmp_path)


@needs_promtool
def test_etcd_unreachable_is_quiet_for_a_router_alone(tmp_path):
    inputs = [
        series("pd_router_cluster_etcd_up", "0x10"),
        series("pd_router_cluster_replicas", "0x10"),
    ]
    fires_for("PDRouterEtcdUnreachable", inputs, [], tmp_path)
