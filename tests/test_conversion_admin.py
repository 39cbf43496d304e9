"""The conversion admin API behind an admin key, and ``pd-router status`` / ``pd-router convert``
against a real router: 401 without the key on every conversion route, the key never in a log
line or a reply, the command-line tables."""

from __future__ import annotations

import asyncio
import io
import logging

import pytest

from pd_router import admin_client
from tests.conversion_helpers import live_roles, pools
from tests.router_helpers import running_router

KEY = "s3cret-admin-key-7f2c"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=2, speed=0.0)


@pytest.fixture
async def router(cluster):
    prefill, decode = await live_roles(cluster)
    async with running_router(
        cluster, prefill=prefill, decode=decode, admin_api_key=KEY, log_level="debug"
    ) as r:
        yield r


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/convert_pd_role"),
        ("POST", "/pd_role_switch"),
        ("GET", "/conversions"),
        ("GET", "/conversions/c1"),
        ("DELETE", "/conversions/c1"),
    ],
)
async def test_conversion_routes_need_the_admin_key(router, method, path):
    async with router.client() as http:
        response = await http.request(method, path, json={})
        wrong = await http.request(method, path, json={}, headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401
    assert wrong.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


async def test_conversion_with_the_key_works_and_the_key_is_never_logged(router, caplog):
    caplog.set_level(logging.DEBUG)
    async with router.client(headers=AUTH) as http:
        decode = (await pools(http))["decode"][0]
        response = await http.post("/convert_pd_role", json={"server_url": decode})
        listed = await http.get("/conversions")
        back = await http.post("/convert_pd_role", json={"server_url": decode})
    assert response.status_code == 200
    assert back.status_code == 200
    assert KEY not in caplog.text
    assert KEY not in response.text + listed.text
    assert any("conversion" in r.getMessage() for r in caplog.records)


async def test_cli_convert_and_status_print_the_outcome_and_the_pools(router):
    async with router.client(headers=AUTH) as http:
        decode = (await pools(http))["decode"][0]
    converted = io.StringIO()
    code = await asyncio.to_thread(
        admin_client.convert,
        [decode, "--to", "prefill", "--router", router.url, "--admin-key", KEY],
        converted,
    )
    assert code == 0, converted.getvalue()
    assert "decode -> prefill: succeeded" in converted.getvalue()
    shown = io.StringIO()
    code = await asyncio.to_thread(
        admin_client.status, ["--router", router.url, "--admin-key", KEY], shown
    )
    assert code == 0
    text = shown.getvalue()
    assert "Pools" in text and "Recent conversions" in text
    prefill_row = next(line for line in text.splitlines() if line.startswith("prefill"))
    assert prefill_row.split()[1] == "3"
    assert decode in text
    back = io.StringIO()
    assert (
        await asyncio.to_thread(
            admin_client.convert, [decode, "--router", router.url, "--admin-key", KEY], back
        )
        == 0
    )


async def test_cli_without_the_key_fails_with_an_exit_code(router, monkeypatch):
    monkeypatch.delenv(admin_client.ADMIN_KEY_ENV, raising=False)
    code = await asyncio.to_thread(admin_client.status, ["--router", router.url], io.StringIO())
    assert code != 0


async def test_worker_refusing_the_control_call_keeps_its_role_and_stays_healthy(
    cluster_factory,
):
    guarded = await asyncio.to_thread(
        cluster_factory, prefill=1, decode=1, speed=0.0, admin_api_key="worker-only-key"
    )
    async with (
        running_router(guarded, conversion={"min_prefill": 0}) as router,
        router.client() as http,
    ):
        prefill = guarded.prefill_urls[0]
        response = await http.post("/convert_pd_role", json={"server_url": prefill})
        assert response.status_code == 400
        record = response.json()
        assert record["status"] == "restored"
        assert "HTTP 401" in record["message"]
        entry = next(
            w for w in (await http.get("/workers")).json()["workers"] if w["url"] == prefill
        )
        assert (entry["role"], entry["state"], entry["healthy"]) == ("prefill", "active", True)
