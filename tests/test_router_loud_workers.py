"""A worker that does not answer is loud, against real processes: a router started with a
mistyped (unreachable) decode URL logs a warning naming it, ``/readiness`` answers what
docs/router.md says (200 while each pool has a routable worker, 503 when one has none, the
unhealthy workers named either way), the status page's JSON and ``pd-router status`` list it
first as unhealthy, and ``[health] startup_wait_secs`` makes the router wait for its workers:
it exits 1 naming those that never answer and serves once a late one comes up."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
import tempfile

import orjson
import pytest

from pd_router.cli import admin_client
from pd_worker.cluster import free_port
from tests.router_helpers import (
    fault,
    generate_body,
    router_overrides,
    running_router,
    wait_until,
)
from tests.router_process import ENTRY, ready, router_process

EXIT_TIMEOUT_SECS = 20.0


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


def unreachable_url() -> str:
    """A loopback URL nothing listens on (a mistyped port)."""
    return f"http://127.0.0.1:{free_port()}"


async def test_an_unreachable_decode_is_logged_at_start_up_as_a_warning_naming_it(cluster):
    mistyped = unreachable_url()
    decode = [*cluster.decode_urls, mistyped]
    async with router_process(prefill=cluster.prefill_urls, decode=decode) as router:
        await wait_until(lambda: mistyped in router.log_text(), 10.0, "warning logged")
        lines = [line for line in router.log_text().splitlines() if mistyped in line]
        assert any("WARNING" in line and "decode" in line for line in lines), lines


async def test_readiness_is_200_and_names_the_unreachable_worker_while_its_pool_has_another(
    cluster,
):
    mistyped = unreachable_url()
    decode = [*cluster.decode_urls, mistyped]
    async with running_router(cluster, decode=decode) as router, router.client() as http:
        response = await http.get("/readiness")
        assert response.status_code == 200
        body = response.json()
        assert body["ready"] is True
        assert body["status"] == "ready"
        assert body["healthy"] == {"prefill": 1, "decode": 1}
        (entry,) = body["unhealthy"]
        assert (entry["url"], entry["role"]) == (mistyped, "decode")
        assert entry["error"]


async def test_readiness_is_503_when_the_only_decode_is_unreachable(cluster):
    mistyped = unreachable_url()
    async with running_router(cluster, decode=[mistyped]) as router, router.client() as http:
        response = await http.get("/readiness")
        assert response.status_code == 503
        body = response.json()
        assert (body["ready"], body["status"]) == (False, "not ready")
        assert [w["url"] for w in body["unhealthy"]] == [mistyped]


async def test_liveness_is_200_even_when_no_worker_answers():
    async with (
        running_router(prefill=[unreachable_url()], decode=[unreachable_url()]) as router,
        router.client() as http,
    ):
        response = await http.get("/liveness")
        assert response.status_code == 200
        assert (await http.get("/readiness")).status_code == 503


async def test_status_lists_the_unreachable_worker_first_as_unhealthy(cluster):
    mistyped = unreachable_url()
    decode = [*cluster.decode_urls, mistyped]
    async with running_router(cluster, decode=decode) as router, router.client() as http:
        workers = (await http.get("/status")).json()["workers"]
        assert workers[0]["url"] == mistyped
        assert workers[0]["healthy"] is False
        assert all(w["healthy"] for w in workers[1:])


async def test_cli_status_shows_the_unreachable_worker_first_as_unhealthy(cluster):
    mistyped = unreachable_url()
    decode = [*cluster.decode_urls, mistyped]
    async with running_router(cluster, decode=decode) as router:
        out = io.StringIO()
        code = await asyncio.to_thread(admin_client.status, ["--router", router.url], out)
    assert code == 0
    table = out.getvalue().split("Workers\n", 1)[1].split("\n\n", 1)[0].splitlines()
    first = table[1].split()
    assert first[1] == mistyped
    assert "UNHEALTHY" in first
    assert f"{mistyped} unhealthy:" in out.getvalue()


@contextlib.asynccontextmanager
async def spawned_router(prefill: list[str], decode: list[str], wait_secs: float):
    """A router process with ``health.startup_wait_secs``; yields (process, port, log file)."""
    port = free_port()
    config = router_overrides(prefill, decode, health={"startup_wait_secs": wait_secs})
    config["port"] = port
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ENTRY, orjson.dumps(config).decode(),
            stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        try:
            yield process, port, log
        finally:
            if process.returncode is None:
                process.terminate()
                await process.wait()


def read_log(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


async def test_startup_wait_exits_1_naming_the_worker_that_never_answers(cluster):
    mistyped = unreachable_url()
    decode = [*cluster.decode_urls, mistyped]
    async with spawned_router(cluster.prefill_urls, decode, 1.0) as (process, _, log):
        code = await asyncio.wait_for(process.wait(), EXIT_TIMEOUT_SECS)
        text = read_log(log)
    assert code == 1, text
    (line,) = [line for line in text.splitlines() if "startup_wait_secs" in line]
    assert "ERROR" in line and mistyped in line
    assert cluster.decode_urls[0] not in line


async def test_startup_wait_serves_once_a_late_worker_comes_up(cluster_factory):
    late = await asyncio.to_thread(cluster_factory, prefill=1, decode=1, speed=0.0)
    decode = late.decode_urls[0]
    await asyncio.to_thread(late.kill, decode)
    async with spawned_router(late.prefill_urls, [decode], 30.0) as (process, port, log):
        url = f"http://127.0.0.1:{port}"
        await asyncio.sleep(1.0)
        assert process.returncode is None
        assert not await ready(url), "served before its decode came up"
        await asyncio.to_thread(late.restart, decode)
        await wait_until(lambda: ready(url), 20.0, "router ready")
        assert process.returncode is None, read_log(log)


def warnings_naming(caplog, url: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and url in r.getMessage()
    ]


async def test_a_worker_going_down_and_coming_back_is_logged_as_a_warning_each_time(
    cluster_factory, caplog
):
    caplog.set_level(logging.INFO, logger="pd_router")
    workers = await asyncio.to_thread(cluster_factory, prefill=1, decode=1, speed=0.0)
    decode = workers.decode_urls[0]
    async with running_router(workers) as router:
        worker = router.state.registry.get(decode)
        await asyncio.to_thread(workers.kill, decode)
        await wait_until(lambda: not worker.healthy, 10.0, "decode unhealthy")
        assert any("unhealthy" in m for m in warnings_naming(caplog, decode))
        await asyncio.to_thread(workers.restart, decode)
        await wait_until(lambda: worker.healthy, 10.0, "decode healthy")
        assert any("healthy again" in m for m in warnings_naming(caplog, decode))


async def test_a_circuit_that_opens_is_logged_as_a_warning_naming_the_worker(cluster, caplog):
    caplog.set_level(logging.INFO, logger="pd_router")
    decode = cluster.decode_urls[0]
    await fault(decode, fail_next=1, fail_status=500)
    try:
        async with (
            running_router(
                cluster, circuit={"failure_threshold": 1, "cooldown_secs": 60.0},
                retry={"max_attempts": 1},
            ) as router,
            router.client() as http,
        ):  # fmt: skip
            response = await http.post("/generate", json=generate_body("trip", 2))
            assert response.status_code == 502
            assert any("circuit open" in m for m in warnings_naming(caplog, decode))
    finally:
        await fault(decode, clear=True)
