"""CORS (``cors_allowed_origins``): a browser page from an allowed origin may call the router;
a page from any other origin may not read its answers. Nothing changes when the list is empty."""

from __future__ import annotations

import pytest

from pd_router.config import ConfigError, load_config
from tests.router_helpers import generate_body, running_router

ALLOWED = "https://app.example.com"
REFUSED = "https://evil.example.net"
ADMIN_KEY = "admin-secret"


def preflight(origin: str, method: str = "POST") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "content-type, authorization",
    }


@pytest.fixture
async def router(pd_cluster):
    async with running_router(
        pd_cluster, cors_allowed_origins=[ALLOWED], admin_api_key=ADMIN_KEY
    ) as r:
        yield r


@pytest.fixture
async def http(router):
    async with router.client() as client:
        yield client


async def test_preflight_from_an_allowed_origin_is_answered(http):
    response = await http.options("/v1/chat/completions", headers=preflight(ALLOWED))
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED
    assert "POST" in response.headers["Access-Control-Allow-Methods"]
    assert response.headers["Access-Control-Allow-Headers"] == "content-type, authorization"


async def test_preflight_from_another_origin_is_refused(http):
    response = await http.options("/v1/chat/completions", headers=preflight(REFUSED))
    assert response.status_code == 403
    assert "Access-Control-Allow-Origin" not in response.headers


async def test_preflight_to_an_admin_path_needs_no_credentials(http):
    response = await http.options("/workers", headers=preflight(ALLOWED, "DELETE"))
    assert response.status_code == 204
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED


async def test_answer_to_an_allowed_origin_carries_allow_origin(http):
    response = await http.get("/v1/models", headers={"Origin": ALLOWED})
    assert response.status_code == 200
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED
    assert "X-Request-Id" in response.headers["Access-Control-Expose-Headers"]


async def test_answer_to_another_origin_has_no_allow_origin(http):
    response = await http.get("/v1/models", headers={"Origin": REFUSED})
    assert response.status_code == 200
    assert "Access-Control-Allow-Origin" not in response.headers


async def test_stream_to_an_allowed_origin_carries_allow_origin(http):
    body = generate_body("cors stream", 3, stream=True)
    response = await http.post("/generate", json=body, headers={"Origin": ALLOWED})
    assert response.status_code == 200
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED


async def test_error_to_an_allowed_origin_carries_allow_origin(http):
    response = await http.get("/workers", headers={"Origin": ALLOWED})
    assert response.status_code == 401
    assert response.headers["Access-Control-Allow-Origin"] == ALLOWED


async def test_wildcard_allows_every_origin(pd_cluster):
    async with (
        running_router(pd_cluster, cors_allowed_origins=["*"]) as router,
        router.client() as http,
    ):
        answered = await http.options("/generate", headers=preflight(REFUSED))
        simple = await http.get("/v1/models", headers={"Origin": REFUSED})
    assert answered.status_code == 204
    assert answered.headers["Access-Control-Allow-Origin"] == "*"
    assert simple.headers["Access-Control-Allow-Origin"] == "*"


async def test_without_allowed_origins_no_cors_headers_are_added(pd_cluster):
    async with running_router(pd_cluster) as router, router.client() as http:
        answered = await http.options("/generate", headers=preflight(ALLOWED))
        simple = await http.get("/v1/models", headers={"Origin": ALLOWED})
    assert answered.status_code == 405
    assert "Access-Control-Allow-Origin" not in answered.headers
    assert "Access-Control-Allow-Origin" not in simple.headers


def test_allowed_origins_load_from_a_list():
    config = load_config(None, {"cors_allowed_origins": [ALLOWED, "http://127.0.0.1:8080", "*"]})
    assert config.cors_allowed_origins == (ALLOWED, "http://127.0.0.1:8080", "*")


@pytest.mark.parametrize("origin", ["app.example.com", "https://app.example.com/", "ftp://x"])
def test_an_entry_that_is_not_an_origin_is_a_config_error(origin):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"cors_allowed_origins": [origin]})
    assert err.value.key == "cors_allowed_origins"


def test_allowed_origins_must_be_a_list_of_strings():
    with pytest.raises(ConfigError) as err:
        load_config(None, {"cors_allowed_origins": ALLOWED})
    assert err.value.key == "cors_allowed_origins"
