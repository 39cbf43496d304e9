"""Several router replicas in front of one 2P2D cluster of reference workers, agreeing through a
real etcd: conversions through one replica while clients send through all, workers added
through one and served through another, a replica killed in the middle of a drain, etcd
stopped and restarted."""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import time

import httpx
import pytest

from pd_router.cli import admin_client
from pd_router.cli.progress import describe
from pd_router.config import load_config
from pd_router.runtime.router import build_app
from pd_router.runtime.serve import start_server
from pd_worker.testing import pd_generate
from tests.conversion_helpers import LONG, wait_for_busy, worker_role
from tests.replica_helpers import (
    LEASE_TTL_SECS,
    cluster_config,
    cluster_view,
    failures,
    load_on_all,
    more_requests,
    replicas,
    roles_agree,
    workers_of,
)
from tests.router_helpers import assert_paired, generate_body, router_overrides, wait_until
from tests.router_process import RouterProcess, router_process

SPEED = 0.05


@pytest.fixture
def workers(cluster_factory):
    return cluster_factory(prefill=2, decode=2, speed=SPEED)


async def test_a_conversion_through_one_replica_fails_no_request_sent_through_any(
    workers, etcd_server
):
    prefill = workers.prefill_urls[0]
    async with replicas(workers, etcd_server, 3) as routers:
        async with load_on_all(routers, 32) as loads, httpx.AsyncClient(timeout=60.0) as http:
            await more_requests(loads, 10)
            body = {"server_url": prefill}
            there = await http.post(routers[0].url + "/convert_pd_role", json=body)
            back = await http.post(routers[1].url + "/convert_pd_role", json=body)
            await more_requests(loads, 10)
        assert there.status_code == 200 and there.json()["status"] == "succeeded", there.text
        assert back.status_code == 200 and back.json()["status"] == "succeeded", back.text
        assert failures(loads) == []
        await wait_until(lambda: roles_agree(routers, prefill, "prefill"), 2.0, "agreed role")
        epochs = {(await workers_of(r.url))[prefill]["epoch"] for r in routers}
        assert epochs == {2}


async def test_a_draining_worker_is_out_of_every_replica_until_each_has_finished_with_it(
    workers, etcd_server
):
    """The switch waits for a request another replica still has in flight on the worker."""
    async with replicas(workers, etcd_server, 2) as (r1, r2), _client(r1) as via_r1:
        async with _client(r2) as via_r2:
            long = asyncio.create_task(via_r2.post("/generate", json=LONG))
            busy = await wait_for_busy(workers.decode_urls)
            started = await via_r1.post(
                "/convert_pd_role", json={"server_url": busy, "wait": False}
            )
            assert started.status_code == 202, started.text
            await wait_until(lambda: _state_on(r2.url, busy, "draining"), 2.0, "draining on r2")
            assert (await worker_role(busy))["role"] == "decode"
            assert (await long).status_code == 200
        location = started.json()["location"]
        await wait_until(lambda: _conversion_done(via_r1, location), 10.0, "conversion ended")
        record = (await via_r1.get(location)).json()
        assert record["status"] == "succeeded", record
        assert (record["started_by"], record["replica"]) == ("operator", "r1")
        await wait_until(lambda: roles_agree([r1, r2], busy, "prefill"), 2.0, "agreed role")


async def test_one_worker_converted_through_two_replicas_at_once_is_refused_once(
    workers, etcd_server
):
    async with replicas(workers, etcd_server, 2) as (r1, r2), _client(r2) as via_r2:
        long = asyncio.create_task(via_r2.post("/generate", json=LONG))
        busy = await wait_for_busy(workers.decode_urls)
        body = {"server_url": busy, "wait": False}
        async with _client(r1) as via_r1:
            answers = await asyncio.gather(
                via_r1.post("/convert_pd_role", json=body),
                via_r2.post("/convert_pd_role", json=body),
            )
        await long
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [202, 409], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 409).json()["error"]
    assert refused["reason"] == "already_converting"


async def test_a_worker_added_through_one_replica_serves_through_another_within_a_second(
    workers, etcd_server
):
    async with replicas(workers, etcd_server, 2) as (r1, r2):
        new = await asyncio.to_thread(workers.add, "prefill")
        async with httpx.AsyncClient(timeout=10.0) as http:
            added = await http.post(
                r1.url + "/workers",
                json={"url": new.url, "role": "prefill", "bootstrap_port": new.bootstrap_port},
            )
            assert added.status_code == 201, added.text
            since = time.monotonic()
            served_by = set()
            while new.url not in served_by and time.monotonic() - since < 1.0:
                reply = await http.post(r2.url + "/generate", json=generate_body("hello", 2))
                assert reply.status_code == 200, reply.text
                served_by.add(assert_paired(reply.json(), "hello", 2))
        assert new.url in served_by, f"{new.url} served nothing through r2 within 1 s"


async def test_a_worker_removed_through_one_replica_leaves_every_replica(workers, etcd_server):
    gone = workers.decode_urls[0]
    async with replicas(workers, etcd_server, 2) as (r1, r2):
        async with httpx.AsyncClient(timeout=10.0) as http:
            removed = await http.delete(r1.url + "/workers", params={"url": gone})
        assert removed.status_code == 200, removed.text

        async def gone_from_r2() -> bool:
            return gone not in await workers_of(r2.url)

        await wait_until(gone_from_r2, 2.0, "removed on r2")


async def test_a_replica_killed_in_the_middle_of_a_drain_leaves_no_worker_stuck(
    workers, etcd_server
):
    async with replicas(workers, etcd_server, 2) as (r1, r2), _client(r2) as via_r2:
        long = asyncio.create_task(via_r2.post("/generate", json=LONG))
        busy = await wait_for_busy(workers.decode_urls)
        async with _client(r1) as via_r1:
            started = await via_r1.post(
                "/convert_pd_role",
                json={"server_url": busy, "wait": False, "drain_timeout_secs": 60},
            )
        assert started.status_code == 202, started.text
        await wait_until(lambda: _state_on(r2.url, busy, "draining"), 2.0, "draining")
        r1.process.send_signal(signal.SIGKILL)
        await r1.process.wait()
        assert (await long).status_code == 200
        await wait_until(
            lambda: _state_on(r2.url, busy, "active"),
            LEASE_TTL_SECS + 5.0,
            "settled by the surviving replica",
        )
        role = await worker_role(busy)
        assert (role["role"], role["draining"]) == ("decode", False)
        entry = (await workers_of(r2.url))[busy]
        assert (entry["role"], entry["conversion"]) == ("decode", None)
        reply = await via_r2.post("/generate", json=generate_body("after", 2))
        assert reply.status_code == 200


async def test_etcd_away_keeps_traffic_flowing_refuses_conversions_then_recovers(
    workers, etcd_server
):
    prefill = workers.prefill_urls[0]
    async with replicas(workers, etcd_server, 2) as routers:
        async with load_on_all(routers, 8) as loads, _client(routers[0]) as http:
            await asyncio.to_thread(etcd_server.stop)
            await wait_until(lambda: _etcd_down(routers), 10.0, "replicas see etcd away")
            refused = await http.post("/convert_pd_role", json={"server_url": prefill})
            await more_requests(loads, 10)
            await asyncio.to_thread(etcd_server.start)
            await wait_until(lambda: _etcd_up(routers), 10.0, "replicas see etcd back")
            converted = await http.post("/convert_pd_role", json={"server_url": prefill})
            await more_requests(loads, 10)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "cluster_unavailable"
        assert converted.status_code == 200, converted.text
        assert failures(loads) == []
        await wait_until(lambda: roles_agree(routers, prefill, "decode"), 2.0, "agreed role")


async def test_only_one_replica_leads_and_another_takes_over_when_it_stops(workers, etcd_server):
    async with replicas(workers, etcd_server, 2) as (r1, r2):
        leaders = {(await cluster_view(r.url))["leader"] for r in (r1, r2)}
        assert len(leaders) == 1
        leader, follower = (r1, r2) if leaders == {"r1"} else (r2, r1)
        leader.process.send_signal(signal.SIGTERM)
        await leader.process.wait()
        survivor = "r2" if follower is r2 else "r1"

        async def took_over() -> bool:
            return (await cluster_view(follower.url))["leader"] == survivor

        await wait_until(took_over, LEASE_TTL_SECS + 3.0, "the other replica leads")


async def _kill_once_switching(r1: RouterProcess, r2: RouterProcess, decode: str) -> None:
    """Convert ``decode`` through r1 and SIGKILL r1 once r2 sees the worker SWITCHING."""
    async with _client(r1) as via_r1:
        started = await via_r1.post("/convert_pd_role", json={"server_url": decode, "wait": False})
    assert started.status_code == 202, started.text
    await wait_until(lambda: _state_on(r2.url, decode, "switching"), 2.0, "switching")
    r1.process.send_signal(signal.SIGKILL)
    await r1.process.wait()


def _client(router: RouterProcess) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=router.url, timeout=60.0)


async def _state_on(router_url: str, worker_url: str, state: str) -> bool:
    entry = (await workers_of(router_url)).get(worker_url)
    return entry is not None and entry["state"] == state


async def _conversion_done(http: httpx.AsyncClient, location: str) -> bool:
    status = (await http.get(location)).json()["status"]
    return status not in ("draining", "switching", "verifying")


async def test_a_drain_waiting_for_another_replica_names_it_in_its_progress(workers, etcd_server):
    async with (
        replicas(workers, etcd_server, 2) as (r1, r2),
        _client(r1) as via_r1,
        _client(r2) as via_r2,
    ):
        long = asyncio.create_task(via_r2.post("/generate", json=LONG))
        busy = await wait_for_busy(workers.decode_urls)
        started = await via_r1.post("/convert_pd_role", json={"server_url": busy, "wait": False})
        location = started.json()["location"]

        async def waits_for_r2() -> bool:
            progress = (await via_r1.get(location)).json()["progress"]
            return progress.get("waiting_for_replicas") == ["r2"]

        await wait_until(waits_for_r2, 2.0, "the record names r2")
        line = describe((await via_r1.get(location)).json(), 1.0)
        assert "in-flight 0 of 0" in line and "waiting for replica r2" in line, line
        assert (await long).status_code == 200
        await wait_until(lambda: _conversion_done(via_r1, location), 10.0, "conversion ended")


async def _etcd_down(routers) -> bool:
    return [(await cluster_view(r.url))["etcd_up"] for r in routers] == [False] * len(routers)


async def _etcd_up(routers) -> bool:
    return [(await cluster_view(r.url))["etcd_up"] for r in routers] == [True] * len(routers)


async def test_a_replica_started_without_workers_takes_the_clusters(workers, etcd_server):
    async with (
        replicas(workers, etcd_server, 1) as (r1,),
        router_process(
            prefill=[], decode=[], cluster=cluster_config(etcd_server, "r2"), log_format="text"
        ) as r2,
    ):
        assert set(await workers_of(r2.url)) == set(workers.urls)
        async with _client(r2) as via_r2:
            reply = await via_r2.post("/generate", json=generate_body("joined", 2))
        assert reply.status_code == 200, reply.text
        assert (await cluster_view(r1.url))["replicas"] == ["r1", "r2"]


async def test_the_cluster_wide_cap_refuses_a_second_conversion_through_another_replica(
    workers, etcd_server
):
    async with replicas(workers, etcd_server, 2) as (r1, r2), _client(r2) as via_r2:
        long = asyncio.create_task(via_r2.post("/generate", json=LONG))
        busy = await wait_for_busy(workers.decode_urls)
        async with _client(r1) as via_r1:
            first = await via_r1.post("/convert_pd_role", json={"server_url": busy, "wait": False})
        other = next(url for url in workers.decode_urls if url != busy)
        second = await via_r2.post("/convert_pd_role", json={"server_url": other})
        await long
    assert first.status_code == 202, first.text
    assert second.status_code == 409, second.text
    assert second.json()["error"]["reason"] == "too_many_conversions"


async def test_converting_the_last_two_prefills_through_two_replicas_at_once_refuses_one(
    workers, etcd_server
):
    """Each replica's pool minimum holds across replicas: both conversions cannot pass it."""
    async with (
        replicas(workers, etcd_server, 2, conversion={"max_concurrent": 2}) as routers,
        httpx.AsyncClient(timeout=60.0) as http,
    ):
        answers = await asyncio.gather(
            *(
                http.post(router.url + "/convert_pd_role", json={"server_url": url})
                for router, url in zip(routers, workers.prefill_urls, strict=True)
            )
        )
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200, 409], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 409).json()["error"]
    assert refused["reason"] in ("min_prefill", "cluster_changed")


async def test_a_replica_killed_while_its_worker_switches_leaves_the_worker_in_its_new_role(
    cluster_factory, etcd_server
):
    workers = cluster_factory(prefill=2, decode=2, speed=1.0, switch_secs=1.5)
    decode = workers.decode_urls[0]
    async with replicas(workers, etcd_server, 2) as (r1, r2):
        await _kill_once_switching(r1, r2, decode)
        await wait_until(
            lambda: roles_agree([r2], decode, "prefill"),
            LEASE_TTL_SECS + 8.0,
            "the survivor has the worker in the role it switched to",
        )
        assert (await worker_role(decode))["role"] == "prefill"
        async with _client(r2) as via_r2:
            reply = await via_r2.post("/generate", json=generate_body("after", 2))
        assert reply.status_code == 200


async def test_status_of_a_replica_names_its_cluster_peers_leader_and_etcd(workers, etcd_server):
    async with replicas(workers, etcd_server, 2) as (r1, _):
        out = io.StringIO()
        code = await asyncio.to_thread(admin_client.status, ["--router", r1.url], out)
    assert code == 0, out.getvalue()
    first = out.getvalue().splitlines()[0]
    assert first == "Cluster test: replica r1 of [r1, r2], leader r1, etcd reachable"


async def test_a_frozen_replica_holds_a_drain_no_longer_than_its_lease(workers, etcd_server):
    """A replica that stops answering (SIGSTOP) with a request in flight on the worker cannot
    report; once its lease expires it is no longer a replica to wait for."""
    async with replicas(workers, etcd_server, 2) as (r1, r2), _client(r2) as via_r2:
        long = asyncio.create_task(via_r2.post("/generate", json=LONG, timeout=5.0))
        busy = await wait_for_busy(workers.decode_urls)
        r2.process.send_signal(signal.SIGSTOP)
        try:
            async with _client(r1) as via_r1:
                started = time.monotonic()
                reply = await via_r1.post("/convert_pd_role", json={"server_url": busy})
                took = time.monotonic() - started
        finally:
            r2.process.send_signal(signal.SIGCONT)
        with contextlib.suppress(httpx.HTTPError):
            await long
    assert reply.status_code == 200 and reply.json()["status"] == "succeeded", reply.text
    assert took < LEASE_TTL_SECS + 5.0


async def test_the_replica_that_converts_a_worker_never_puts_it_back_in_its_old_pool(
    workers, etcd_server
):
    prefill = workers.prefill_urls[0]
    overrides = router_overrides(
        workers.prefill_urls, workers.decode_urls, cluster=cluster_config(etcd_server, "r1")
    )
    server = await start_server(build_app(load_config(None, overrides)), "127.0.0.1", 0)
    try:
        registry = server.router.registry
        left: list[str] = []
        registry.on_left_pool(
            lambda worker, role: left.append(role.value) if worker.url == prefill else None
        )
        async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as http:
            reply = await http.post(
                "/convert_pd_role", json={"server_url": prefill, "new_role": "decode"}
            )
        assert reply.status_code == 200, reply.text
        # Once this replica's view has applied every record up to etcd's current revision, the
        # echoes of the conversion's own records have been through its mirror.
        await server.router.cluster.catch_up()
        assert left == ["prefill"]
    finally:
        await server.stop()


async def test_a_replica_killed_while_its_worker_drains_itself_is_settled_in_the_role_it_took(
    workers, etcd_server
):
    """The switch call went out and the worker waits for foreign traffic before it switches:
    the surviving replica settles the worker once that conversion ended, not as the role it is
    about to leave."""
    decode, prefill = workers.decode_urls[0], workers.prefill_urls[0]
    foreign = {"text": "from another router", "sampling_params": {"max_new_tokens": 6000}}
    async with (
        replicas(workers, etcd_server, 2) as (r1, r2),
        httpx.AsyncClient(timeout=60.0) as direct,
    ):
        other = asyncio.create_task(
            pd_generate(direct, prefill, decode, workers.bootstrap_port(prefill), foreign)
        )
        await wait_for_busy([decode])
        await _kill_once_switching(r1, r2, decode)
        await other
        await wait_until(
            lambda: roles_agree([r2], decode, "prefill"), 10.0, "settled in its new role"
        )
        assert (await worker_role(decode))["role"] == "prefill"
        assert f"of worker {decode} lost its replica r1; settled as prefill" in r2.log_text()


async def test_a_replica_whose_lease_lapsed_mid_drain_does_not_switch_a_worker_settled_meanwhile(
    workers, etcd_server
):
    """r1 stops answering (SIGSTOP) while its conversion drains; its lease expires and r2 settles
    the worker in its old role. r1, back, must not call the switch: the record r2 published
    would then name a role the worker no longer has."""
    async with replicas(workers, etcd_server, 2) as (r1, r2), _client(r1) as via_r1:
        long = asyncio.create_task(via_r1.post("/generate", json=LONG, timeout=30.0))
        busy = await wait_for_busy(workers.decode_urls)
        started = await via_r1.post("/convert_pd_role", json={"server_url": busy, "wait": False})
        assert started.status_code == 202, started.text
        location = started.json()["location"]
        await wait_until(lambda: _state_on(r2.url, busy, "draining"), 2.0, "draining on r2")
        r1.process.send_signal(signal.SIGSTOP)
        try:
            await wait_until(
                lambda: _state_on(r2.url, busy, "active"), LEASE_TTL_SECS + 5.0, "settled by r2"
            )
        finally:
            r1.process.send_signal(signal.SIGCONT)
        with contextlib.suppress(httpx.HTTPError):
            await long
        await wait_until(lambda: _conversion_done(via_r1, location), 10.0, "conversion ended")
        record = (await via_r1.get(location)).json()
        assert record["status"] != "succeeded", record
        assert (await worker_role(busy))["role"] == "decode"
        assert (await workers_of(r2.url))[busy]["role"] == "decode"
