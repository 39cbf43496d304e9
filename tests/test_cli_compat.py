"""Drop-in compatibility with sglang-router 0.3.2 and smg 1.13: their PD command lines start
pd-router unchanged, every option of theirs is in pd_router.compat's table (checked against
recorded ``--help`` outputs), inapplicable options are named once in a start-up warning, and
the client's request id is read from the configured headers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from pd_router.config import ConfigError, load_config
from tests.router_helpers import generate_body, running_router

WORKERS = ["--prefill", "http://127.0.0.1:30001", "--decode", "http://127.0.0.1:30011"]


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


@contextlib.asynccontextmanager
async def client_of_router(cluster, **overrides) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of a real router over ``cluster`` configured with ``overrides``."""
    async with running_router(cluster, **overrides) as router, router.client() as http:
        yield http


async def test_request_id_is_read_from_the_configured_headers_in_order(cluster):
    headers = ["x-trace-id", "x-correlation-id"]
    async with client_of_router(cluster, request_id_headers=headers) as http:
        both = {"X-Correlation-Id": "corr-1", "X-Trace-Id": "trace-1", "X-Request-Id": "r-1"}
        response = await http.post("/generate", json=generate_body("ids"), headers=both)
        assert response.status_code == 200
        assert response.headers["X-Request-Id"] == "trace-1"
        assert response.json()["meta_info"]["id"].startswith("trace-1-")
        second = {"X-Correlation-Id": "corr-2", "X-Request-Id": "r-2"}
        response = await http.post("/generate", json=generate_body("ids"), headers=second)
        assert response.headers["X-Request-Id"] == "corr-2"


async def test_x_request_id_is_still_read_after_the_configured_headers(cluster):
    async with client_of_router(cluster, request_id_headers=["x-trace-id"]) as http:
        response = await http.post(
            "/generate", json=generate_body("ids"), headers={"X-Request-Id": "plain-7"}
        )
        assert response.headers["X-Request-Id"] == "plain-7"


async def test_configured_request_id_header_is_echoed_on_a_stream(cluster):
    async with client_of_router(cluster, request_id_headers=["x-trace-id"]) as http:
        body = generate_body("ids", stream=True)
        headers = {"X-Trace-Id": "stream-9"}
        async with http.stream("POST", "/generate", json=body, headers=headers) as response:
            assert response.headers["X-Request-Id"] == "stream-9"
            await response.aread()


@pytest.mark.parametrize("names", [["x trace"], [""], ["x-id\r\n"], "x-trace-id", [3]])
def test_request_id_headers_must_be_a_list_of_header_names(names):
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"request_id_headers": names})
    assert caught.value.key.startswith("request_id_headers")
