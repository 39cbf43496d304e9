"""``pd-router status``, ``convert`` and ``autopilot`` against a router with an admin key:
without a key the read-only commands show what the status page shows anyone (the redacted
view); a refused key is reported as wrong, a missing one as required, with one exit status
(3) for both in every command."""

from __future__ import annotations

import asyncio

import pytest

from tests.cli_process import PD_ROUTER, run
from tests.router_helpers import running_router

KEY = "keyed-router-test-key"
EXIT_AUTH = 3


@pytest.fixture
async def router(pd_cluster):
    async with running_router(pd_cluster, admin_api_key=KEY) as r:
        yield r


async def cli(*args: str, key: str | None = None):
    env = {"PD_ROUTER_ADMIN_KEY": key} if key is not None else None
    return await asyncio.to_thread(run, PD_ROUTER, *args, env=env)


async def test_status_without_a_key_shows_the_redacted_view(router, pd_cluster):
    result = await cli("status", "--router", router.url)
    assert result.returncode == 0, result.stderr
    for url in pd_cluster.urls:
        assert url in result.stdout
    assert "Redacted view" in result.stdout and "PD_ROUTER_ADMIN_KEY" in result.stdout


async def test_autopilot_without_a_key_shows_its_mode(router):
    result = await cli("autopilot", "--router", router.url)
    assert result.returncode == 0, result.stderr
    assert "autopilot: off" in result.stdout
    assert "Redacted view" in result.stdout


@pytest.mark.parametrize(
    "command",
    [("status",), ("autopilot",), ("autopilot", "--mode", "off"), ("convert", "w1")],
    ids=lambda c: " ".join(c),
)
async def test_a_wrong_key_is_reported_as_wrong_with_the_auth_exit_status(router, command):
    result = await cli(*command, "--router", router.url, key="not-the-key")
    assert result.returncode == EXIT_AUTH, result.stderr
    assert "wrong admin key" in result.stderr
    assert "not-the-key" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "command", [("autopilot", "--mode", "off"), ("convert", "w1")], ids=lambda c: " ".join(c)
)
async def test_a_change_without_a_key_is_reported_as_key_required_with_the_auth_exit_status(
    router, command
):
    result = await cli(*command, "--router", router.url)
    assert result.returncode == EXIT_AUTH, result.stderr
    assert "admin key required" in result.stderr


async def test_the_router_tells_a_wrong_key_from_a_missing_one(router):
    async with router.client() as http:
        missing = await http.get("/workers")
        wrong = await http.get("/workers", headers={"Authorization": "Bearer nope"})
    assert missing.status_code == wrong.status_code == 401
    assert "required" in missing.json()["error"]["message"]
    assert "wrong admin API key" in wrong.json()["error"]["message"]
