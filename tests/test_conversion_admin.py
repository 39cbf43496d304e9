"""The conversion admin API behind an admin key, and ``pd-router status`` / ``pd-router convert``
against a real router: 401 without the key on every conversion route, the key never in a log
line or a reply, the command-line tables."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Callable

import pytest

from pd_router.cli import admin_client, admin_http
from pd_router.cli.convert import convert as cli_convert
from tests.conversion_helpers import live_roles, pools
from tests.model_clusters import big_and_small, models_and_roles, regular_entries, wait_for_models
from tests.router_helpers import running_router, wait_until

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


async def cli(command: Callable[..., int], argv: list[str]) -> tuple[int, str]:
    """Run ``pd-router convert``/``status`` (in a thread: they are blocking httpx clients)."""
    out = io.StringIO()
    code = await asyncio.to_thread(command, [*argv, "--admin-key", KEY], out)
    return code, out.getvalue()


async def test_cli_convert_prints_the_outcome_and_exits_zero(router):
    async with router.client(headers=AUTH) as http:
        decode = (await pools(http))["decode"][0]
    code, text = await cli(cli_convert, [decode, "--to", "prefill", "--router", router.url])
    assert code == 0, text
    assert f"{decode} decode -> prefill: succeeded" in text
    assert KEY not in text
    code, _ = await cli(cli_convert, [decode, "--router", router.url])
    assert code == 0


async def test_cli_status_prints_the_pools_every_worker_and_recent_conversions(router, cluster):
    async with router.client(headers=AUTH) as http:
        decode = (await pools(http))["decode"][0]
        await http.post("/convert_pd_role", json={"server_url": decode})
        code, text = await cli(admin_client.status, ["--router", router.url])
        await http.post("/convert_pd_role", json={"server_url": decode})
    assert code == 0, text
    pool_rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[:4]}
    assert pool_rows["prefill"][0] == "3" and pool_rows["decode"][0] == "1"
    for url in cluster.urls:
        assert url in text
    assert "model" not in text.split("Workers\n", 1)[1].split()[:4]
    recent = text.split("Recent conversions\n", 1)[1].splitlines()
    (row,) = [line.split() for line in recent if decode in line]
    assert row[1:6] == [decode, "decode", "prefill", "operator", "succeeded"]
    assert KEY not in text


async def test_cli_convert_without_the_key_fails_with_the_auth_exit_status(router, monkeypatch):
    monkeypatch.delenv(admin_http.ADMIN_KEY_ENV, raising=False)
    async with router.client(headers=AUTH) as http:
        decode = (await pools(http))["decode"][0]
    code = await asyncio.to_thread(cli_convert, [decode, "--router", router.url], io.StringIO())
    assert code == admin_http.EXIT_AUTH


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


async def test_cli_status_counts_the_pools_per_model_and_names_each_workers_model(
    module_cluster_factory,
):
    big, small = big_and_small(module_cluster_factory)
    async with running_router(big, regular=regular_entries(small), admin_api_key=KEY) as router:
        await wait_for_models(router, AUTH)
        code, text = await cli(admin_client.status, ["--router", router.url])
    assert code == 0, text
    pools, workers = text.split("Pools\n", 1)[1].split("\nWorkers\n", 1)
    assert [line.split() for line in pools.splitlines()] == [
        ["model", "pool", "active", "active+healthy", "workers"],
        ["big", "prefill", "1", "1", "1"],
        ["big", "decode", "2", "2", "2"],
        ["small", "regular", "2", "2", "2"],
    ]
    rows = {row[1]: tuple(row[2:4]) for row in map(str.split, workers.splitlines()[1:6])}
    assert rows == models_and_roles(big, small)


async def test_cli_autopilot_shows_each_pd_models_pools_and_decisions(module_cluster_factory):
    big, _ = big_and_small(module_cluster_factory)
    medium = module_cluster_factory(
        prefill=1, decode=1, extra_args=("--served-model-name", "medium")
    )
    autopilot = {"mode": "recommend", "interval_secs": 0.05, "window_secs": 0.05}
    async with running_router(
        prefill=big.prefill_urls + medium.prefill_urls,
        decode=big.decode_urls + medium.decode_urls,
        autopilot=autopilot,
        admin_api_key=KEY,
    ) as router:

        async def both_decided() -> bool:
            async with router.client(headers=AUTH) as http:
                models = (await http.get("/autopilot")).json().get("models", {})
            return set(models) == {"big", "medium"} and all(
                pilot["last_decision"] for pilot in models.values()
            )

        await wait_until(both_decided, 10.0, "a decision of each model's pilot")
        code, text = await cli(admin_client.autopilot, ["--router", router.url])
    assert code == 0, text
    sections = dict(section.split("\n", 1) for section in text.split("\nModel ")[1:])
    assert set(sections) == {"big", "medium"}
    for model, (prefill, decode) in (("big", (1, 2)), ("medium", (1, 1))):
        pools = sections[model].split("Pools\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:3]
        assert [row.split()[:2] for row in pools] == [
            ["prefill", str(prefill)],
            ["decode", str(decode)],
        ], sections[model]
        assert "Latest: hold" in sections[model]
