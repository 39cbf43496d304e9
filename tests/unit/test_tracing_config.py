"""``[tracing]``: where spans are sent for the endpoint shapes smg and collectors use, and which
endpoints are refused at start-up."""

from __future__ import annotations

import pytest

from pd_router.config import ConfigError, load_config
from pd_router.tracing import grpc_port_warning, traces_url


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("localhost:4318", "http://localhost:4318/v1/traces"),
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("https://collector:4318/", "https://collector:4318/v1/traces"),
        ("http://collector:4318/otlp/v1/traces", "http://collector:4318/otlp/v1/traces"),
    ],
)
def test_an_endpoint_without_a_path_gets_the_otlp_traces_path(endpoint, url):
    assert traces_url(endpoint) == url


def test_tracing_is_off_by_default():
    assert load_config(None, {}).tracing.enabled is False


@pytest.mark.parametrize(
    ("tracing", "key"),
    [
        ({"endpoint": "ftp://collector:21"}, "tracing.endpoint"),
        ({"endpoint": "http://"}, "tracing.endpoint"),
        ({"endpoint": "collector:port"}, "tracing.endpoint"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
        ({"service_name": ""}, "tracing.service_name"),
    ],
)
def test_a_tracing_value_that_cannot_work_is_refused_naming_its_key(tracing, key):
    with pytest.raises(ConfigError) as refused:
        load_config(None, {"tracing": tracing})
    assert refused.value.key == key


def test_an_endpoint_on_the_grpc_port_is_warned_about():
    assert "OTLP/HTTP" in (grpc_port_warning("0.0.0.0:4317") or "")
    assert grpc_port_warning("0.0.0.0:4318") is None
