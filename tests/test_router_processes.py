"""A router of one control process and three data-plane processes on one port (``[server]
workers = 3``): every process routes from the control process's snapshots, a conversion drains
across all of them, the admin API and the metrics show the whole router whichever process
accepted the request, a data plane that dies or freezes is replaced, the data planes stop when
the control process dies (and kill it when it freezes), SIGTERM lets streams in flight finish,
a data plane balances on the whole router's in-flight counts and places a prefix where the
others do. Real router processes in front of reference workers on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import httpx
import orjson
import pytest

from pd_router.circuit_state import CircuitState
from pd_router.cli.main import config_from_argv
from pd_router.config import ConfigError, load_config
from pd_router.dataplane.front.listener import MAX_BACKLOG
from pd_router.dataplane.link.reports import METRICS_PUSH_SECS
from pd_router.dataplane.routing.policies import make_policy
from pd_router.dataplane.routing.snapshot import SnapshotPools
from pd_router.roles import Role
from pd_router.wire import Snapshot, WorkerEntry
from pd_worker.cluster import WorkerCluster
from tests.conversion_helpers import (
    LONG,
    CheckedLoad,
    conversion_status,
    convert,
    sample,
    wait_for_busy,
)
from tests.router_helpers import (
    assert_paired,
    fault,
    generate_body,
    router_overrides,
    sse_events,
    wait_until,
    worker_metric,
)
from tests.router_process import ENTRY, RouterProcess, router_process

PROCESSES = {"server": {"workers": 3}}
TOKENS = 4


def three_processes(cluster: WorkerCluster, **overrides: Any) -> AbstractAsyncContextManager:
    """A router of three data planes over ``cluster``'s workers (``overrides`` on top)."""
    return router_process(
        prefill=cluster.prefill_urls, decode=cluster.decode_urls, **PROCESSES, **overrides
    )


def dataplane_pids(router: RouterProcess) -> set[int]:
    with open(f"/proc/{router.pid}/task/{router.pid}/children") as f:
        return {int(pid) for pid in f.read().split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


async def fresh_connection_requests(url: str, prompts: list[str]) -> list[httpx.Response]:
    """One request per new connection, so the kernel spreads them over the data planes."""
    answers = []
    for prompt in prompts:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            answers.append(await http.post("/generate", json=generate_body(prompt, TOKENS)))
    return answers


async def paired_sources(url: str, prompts: list[str]) -> list[str]:
    """Send each prompt on a new connection; each answer is a 200 paired with its prompt, and
    the prefill it came from is returned."""
    answers = await fresh_connection_requests(url, prompts)
    sources = []
    for prompt, answer in zip(prompts, answers, strict=True):
        assert answer.status_code == 200, answer.text
        sources.append(assert_paired(answer.json(), prompt, TOKENS))
    return sources


async def wait_for_worker(router: RouterProcess, url: str, field: str, value: str) -> None:
    """Until ``/workers`` (whichever process answers) shows ``field`` of ``url`` at ``value``."""
    async with router.client() as http:

        async def shown() -> bool:
            workers = (await http.get("/workers")).json()["workers"]
            return any(w["url"] == url and w[field] == value for w in workers)

        await wait_until(shown, 5.0, f"{url} {field} {value}")


def test_workers_auto_is_one_data_plane_per_usable_core():
    argv = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    config = config_from_argv([*argv, "--workers", "auto"])
    assert config.server.processes == len(os.sched_getaffinity(0))
    assert config_from_argv([*argv, "--workers", "3"]).server.processes == 3
    assert config_from_argv(argv).server.processes == 1


async def test_more_data_planes_than_usable_cores_are_warned_about(pd_cluster):
    one_core = {min(os.sched_getaffinity(0))}
    async with three_processes(pd_cluster, cores=one_core) as router:
        assert "3 data planes on 1 usable core: they take turns" in router.log_text()


async def test_a_data_plane_per_usable_core_is_not_warned_about(pd_cluster):
    cores = set(sorted(os.sched_getaffinity(0))[:2])
    async with router_process(
        prefill=pd_cluster.prefill_urls, decode=pd_cluster.decode_urls, cores=cores,
        server={"workers": len(cores)},
    ) as router:  # fmt: skip
        assert "usable core" not in router.log_text()


@pytest.mark.parametrize("value", [0, -2, "many", 1.5])
def test_workers_is_auto_or_a_positive_count(value):
    with pytest.raises(ConfigError, match=r"server\.workers"):
        load_config(None, {"server": {"workers": value}})


async def test_metrics_count_every_processs_requests(pd_cluster):
    async with three_processes(pd_cluster) as router:
        answers = await fresh_connection_requests(router.url, [f"m {n}" for n in range(12)])
        assert [a.status_code for a in answers] == [200] * 12
        async with router.client() as http:
            served = await sample(
                http, "pd_router_requests_total", endpoint="/generate", status="200"
            )
        assert served == 12


async def test_the_counts_of_killed_data_planes_stay_in_the_metrics(pd_cluster):
    async with three_processes(pd_cluster) as router:
        answers = await fresh_connection_requests(router.url, [f"k {n}" for n in range(12)])
        assert [a.status_code for a in answers] == [200] * 12
        await asyncio.sleep(2 * METRICS_PUSH_SECS)  # never scraped, but sent unasked
        before = dataplane_pids(router)
        for pid in before:
            os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: len(dataplane_pids(router) - before) == 3, 10.0, "replaced")
        async with router.client() as http:
            served = await sample(
                http, "pd_router_requests_total", endpoint="/generate", status="200"
            )
        assert served == 12


async def test_admin_key_is_checked_whichever_process_accepts(pd_cluster):
    key = {"Authorization": "Bearer sesame"}
    async with three_processes(pd_cluster, admin_api_key="sesame") as router:
        for _ in range(6):
            async with router.client() as http:
                assert (await http.get("/workers")).status_code == 401
            async with router.client(headers=key) as http:
                listed = (await http.get("/workers")).json()["workers"]
            assert sorted(w["url"] for w in listed) == sorted(pd_cluster.urls)


async def test_conversions_under_load_fail_no_request(cluster_factory):
    cluster = cluster_factory(prefill=2, decode=2, speed=0.2)
    async with three_processes(cluster, conversion={"min_prefill": 1, "min_decode": 1}) as router:
        async with CheckedLoad(router.url, concurrency=12, tokens=8) as load:
            await load.wait_for_requests(20)
            async with router.client() as http:
                for url in (cluster.decode_urls[0], cluster.prefill_urls[0]) * 2:
                    answer = await convert(http, server_url=url)
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["success"], answer.text
        assert load.result.failed == 0, load.result.errors[:3]
        assert load.result.ok > 20


async def test_a_role_changed_outside_the_router_reaches_every_process(cluster_factory):
    cluster = cluster_factory(prefill=2, decode=2, speed=0.0)
    switched = cluster.decode_urls[0]
    async with three_processes(cluster, prefill_policy="round_robin") as router:
        async with httpx.AsyncClient(timeout=10.0) as operator:
            reply = await operator.post(
                switched + "/pd_role_switch", json={"new_role": Role.PREFILL.value}
            )
        assert reply.json()["success"]
        await wait_for_worker(router, switched, "role", "prefill")
        assert switched in await paired_sources(router.url, [f"drift {n}" for n in range(18)])


async def test_a_wrong_role_answer_in_a_data_plane_has_the_worker_moved_at_once(
    cluster_factory,
):
    cluster = cluster_factory(prefill=2, decode=2, speed=0.0)
    switched = cluster.decode_urls[0]
    async with three_processes(
        cluster, decode_policy="round_robin", health={"interval_secs": 60.0}
    ) as router:
        async with httpx.AsyncClient(timeout=10.0) as operator:
            reply = await operator.post(switched + "/pd_role_switch", json={"new_role": "prefill"})
        assert reply.json()["success"]
        await paired_sources(router.url, [f"misrouted {n}" for n in range(8)])
        async with router.client() as http:
            assert await sample(
                http, "pd_router_upstream_errors_total", role="decode", kind="wrong_role"
            )
        await wait_for_worker(router, switched, "role", "prefill")


@contextlib.asynccontextmanager
async def failing_decode_circuit_opened(
    cluster: WorkerCluster, cooldown_secs: float
) -> AsyncIterator[tuple[RouterProcess, str]]:
    """A router of three data planes over ``cluster`` (one prefill, two decodes) whose first
    decode failed the data planes' legs until its circuit opened (two failures); it turns
    half-open ``cooldown_secs`` later, and the decode still fails (502) until told otherwise."""
    failing = cluster.decode_urls[0]
    async with three_processes(
        cluster,
        decode_policy="round_robin",
        health={"interval_secs": 60.0},
        circuit={"failure_threshold": 2, "cooldown_secs": cooldown_secs},
    ) as router:
        await fault(failing, fail_next=1000, fail_status=502)
        await paired_sources(router.url, [f"failing leg {n}" for n in range(12)])
        await wait_for_worker(router, failing, "circuit", "open")
        yield router, failing


async def test_legs_failing_in_the_data_planes_open_the_workers_circuit(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    async with failing_decode_circuit_opened(cluster, 60.0) as (router, failing):
        served = await worker_metric(failing, "num_requests_total")
        await paired_sources(router.url, [f"after {n}" for n in range(6)])
        assert await worker_metric(failing, "num_requests_total") == served


async def test_a_half_open_circuit_gets_one_trial_from_the_whole_router(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.0)
    async with failing_decode_circuit_opened(cluster, 0.5) as (router, failing):
        await fault(failing, fail_next=0, delay_secs=10.0)
        stop = asyncio.Event()

        async def client(n: int) -> None:
            async with httpx.AsyncClient(base_url=router.url, timeout=15.0) as http:
                while not stop.is_set():
                    await http.post("/generate", json=generate_body(f"client {n}", TOKENS))

        clients = [asyncio.create_task(client(n)) for n in range(12)]
        seen: list[int] = []
        # Watched from the first sight of the trial for 3 s: well inside the 10 s it is held,
        # after which it succeeds and closes the circuit to every client.
        trial_seen_at = None
        deadline = time.monotonic() + 8.0
        async with router.client() as http:
            while time.monotonic() < deadline:
                workers = (await http.get("/workers")).json()["workers"]
                seen += [w["inflight"] for w in workers if w["url"] == failing]
                if trial_seen_at is None and seen[-1] > 0:
                    trial_seen_at = time.monotonic()
                    deadline = trial_seen_at + 3.0
                await asyncio.sleep(0.02)
        stop.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        assert max(seen) == 1


async def test_a_killed_data_plane_is_replaced_and_its_drain_does_not_hang(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=2, speed=0.05)
    async with three_processes(cluster) as router:
        before = dataplane_pids(router)
        assert len(before) == 3
        async with router.client() as http:
            long = asyncio.create_task(http.post("/generate", json=LONG))
            busy = await wait_for_busy(cluster.decode_urls)
            started = await convert(http, server_url=busy, new_role="prefill", wait=False)
            conversion = started.json()["id"]
            await asyncio.sleep(0.3)
            assert await conversion_status(http, conversion) == "draining"
            for pid in before:
                os.kill(pid, signal.SIGKILL)
            await asyncio.gather(long, return_exceptions=True)

        async def succeeded() -> bool:
            try:
                async with router.client() as http:
                    return await conversion_status(http, conversion) == "succeeded"
            except httpx.HTTPError:
                return False

        await wait_until(succeeded, 10.0, "the conversion ended without the killed requests")
        await wait_until(lambda: len(dataplane_pids(router) - before) == 3, 10.0, "replaced")
        answers = await fresh_connection_requests(router.url, ["after 1", "after 2"])
        assert [a.status_code for a in answers] == [200, 200]


async def test_a_frozen_data_plane_is_replaced_and_the_connections_queued_on_it_served(
    pd_cluster,
):
    async with three_processes(pd_cluster) as router:
        # A data plane serves only once it has reported to the control process, which gives
        # one that never did half a minute to start: have every data plane serve first (30 new
        # connections miss one of three sockets with odds of 1 in 60000).
        await paired_sources(router.url, [f"warm {n}" for n in range(30)])
        frozen = min(dataplane_pids(router))
        os.kill(frozen, signal.SIGSTOP)
        try:
            # New connections: the kernel queues about a third of them on the frozen process's
            # socket, which its replacement takes over.
            await paired_sources(router.url, [f"frozen {n}" for n in range(16)])
            assert not alive(frozen)
        finally:
            if alive(frozen):
                os.kill(frozen, signal.SIGCONT)
        assert len(dataplane_pids(router)) == 3


async def test_data_planes_stop_when_the_control_process_dies(pd_cluster):
    async with three_processes(pd_cluster) as router:
        dataplanes = dataplane_pids(router)
        router.process.send_signal(signal.SIGKILL)
        await router.process.wait()
        await wait_until(
            lambda: not any(alive(pid) for pid in dataplanes), 10.0, "data planes exited"
        )
        async with httpx.AsyncClient(timeout=5.0) as http:
            try:
                await http.get(router.url + "/health")
            except httpx.ConnectError:
                pass
            else:
                raise AssertionError("the port still answers")


async def test_a_frozen_control_process_is_killed_and_its_data_planes_exit(pd_cluster):
    async with three_processes(pd_cluster) as router:
        dataplanes = dataplane_pids(router)
        router.process.send_signal(signal.SIGSTOP)
        await paired_sources(router.url, ["routed from the last snapshot"])
        await asyncio.wait_for(router.process.wait(), 20.0)
        assert router.process.returncode == -signal.SIGKILL
        await wait_until(
            lambda: not any(alive(pid) for pid in dataplanes), 10.0, "data planes exited"
        )
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=5.0) as http:
                await http.get(router.url + "/health")


async def test_sigterm_lets_streams_in_flight_finish(cluster_factory):
    cluster = cluster_factory(prefill=1, decode=1, speed=0.05)
    async with three_processes(cluster) as router:
        body = generate_body("until the end", 20, stream=True)

        async def stream() -> str:
            async with httpx.AsyncClient(base_url=router.url, timeout=30.0) as http:
                return (await http.post("/generate", json=body)).text

        streams = [asyncio.create_task(stream()) for _ in range(4)]

        async def all_dispatched() -> bool:
            # Every stream reached the decode, none is left in a listening socket's queue
            # (SIGTERM closes the sockets, and with them the connections not accepted yet).
            return await worker_metric(cluster.decode_urls[0], "num_requests_total") == 4

        await wait_until(all_dispatched, 5.0, "every stream dispatched to the decode")
        router.process.send_signal(signal.SIGTERM)
        texts = await asyncio.gather(*streams)
        assert all(sse_events(text)[-1] == "[DONE]" for text in texts)
        assert await asyncio.wait_for(router.process.wait(), 10.0) == 0


async def test_cache_aware_sends_a_prefix_to_one_prefill_whichever_process_routes(
    cluster_factory,
):
    cluster = cluster_factory(prefill=2, decode=1, speed=0.0)
    async with three_processes(cluster, prefill_policy="cache_aware") as router:
        for group in range(2):
            system = f"system prompt of group {group} " * 8
            prompts = [f"{system} question {n}" for n in range(5)]
            answers = await fresh_connection_requests(router.url, prompts)
            sources = {
                assert_paired(answer.json(), prompt, TOKENS)
                for prompt, answer in zip(prompts, answers, strict=True)
            }
            assert len(sources) == 1, (group, sources)


async def test_a_second_router_on_the_same_port_is_refused(pd_cluster):
    async with three_processes(pd_cluster) as router:
        config = router_overrides(pd_cluster.prefill_urls, pd_cluster.decode_urls, **PROCESSES)
        config["port"] = router.port
        second = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ENTRY, orjson.dumps(config).decode(),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(second.communicate(), 20.0)
        assert second.returncode != 0
        assert b"Address already in use" in stderr


async def test_every_data_plane_listens_with_the_whole_backlog(pd_cluster):
    overrides = {"server": {"workers": 2}, "max_client_connections": 4096}
    async with router_process(
        prefill=pd_cluster.prefill_urls, decode=pd_cluster.decode_urls, **overrides
    ) as router:
        ss = await asyncio.create_subprocess_exec(
            "ss", "-ltnH", f"sport = :{router.port}", stdout=asyncio.subprocess.PIPE
        )
        listing = (await ss.communicate())[0].decode()
    # For a listening socket, ss shows the backlog as Send-Q (the third column).
    backlogs = [int(line.split()[2]) for line in listing.splitlines()]
    assert backlogs == [MAX_BACKLOG, MAX_BACKLOG]


def decode_entry(
    url: str, circuit: str = "closed", trial: int | None = None, half_open_at: float | None = None
) -> WorkerEntry:
    """A decode as a snapshot carries it."""
    state = CircuitState(circuit)
    return WorkerEntry(url, Role.DECODE, "", 0, None, True, True, state, half_open_at, trial)


def decode_pools(
    policy: str, *urls: str, index: int = 0, half_open: dict[str, int] | None = None
) -> SnapshotPools:
    """Data plane ``index``'s pools after a snapshot of these decodes: closed circuits, but
    those in ``half_open``, each mapped to the data plane the snapshot names for its trial."""
    pools = SnapshotPools(
        {role: make_policy(policy) for role in Role},
        index=index,
        wake=lambda: None,
        suspect=lambda url: None,
        stuck=lambda prefill, decode: None,
        on_unavailable=lambda url: None,
        count_refusal=lambda role, model: None,
    )
    half_open = half_open or {}
    pools.apply(Snapshot(1, tuple(
        decode_entry(url, "half_open", half_open[url]) if url in half_open else decode_entry(url)
        for url in urls
    )))  # fmt: skip
    return pools


def picked(pools: SnapshotPools, times: int) -> list[str]:
    """The urls of ``times`` picks, each dispatched and left in flight."""
    urls = []
    for _ in range(times):
        member = pools.pick(Role.DECODE)
        pools.acquire(member)
        urls.append(member.url)
    return urls


def test_only_the_data_plane_named_for_a_half_open_trial_sends_it():
    half_open = {"http://recovering": 0}
    named = decode_pools("round_robin", "http://ok", "http://recovering", half_open=half_open)
    other = decode_pools(
        "round_robin", "http://ok", "http://recovering", index=1, half_open=half_open
    )
    assert picked(named, 6).count("http://recovering") == 1
    assert "http://recovering" not in picked(other, 6)


def test_a_snapshot_made_before_the_cool_down_ended_lets_no_second_trial_through():
    ok, recovering = "http://ok", "http://recovering"
    pools = decode_pools("round_robin", ok, recovering, half_open={recovering: 0})
    assert picked(pools, 4).count(recovering) == 1
    cooled_down = time.monotonic() - 1.0
    pools.apply(Snapshot(2, (decode_entry(ok), decode_entry(recovering, "open", 0, cooled_down))))
    assert recovering not in picked(pools, 4)


def test_a_data_plane_balances_on_the_whole_routers_inflight_counts():
    pools = decode_pools("least_inflight", "http://busy", "http://idle")
    pools.apply_inflight({"http://busy": 40, "http://idle": 0})
    assert {pools.pick(Role.DECODE).url for _ in range(20)} == {"http://idle"}


def test_a_data_plane_reports_each_workers_leg_outcomes_as_runs_in_order():
    pools = decode_pools("round_robin", "http://a", "http://b")
    a = pools.pick(Role.DECODE)
    b = pools.pick(Role.DECODE, [a])
    for member, ok in [(a, True), (b, True), (a, True), (a, False), (b, True), (a, True)]:
        (member.circuit.record_success if ok else member.circuit.record_failure)()
    outcomes = pools.take_outcomes()
    assert [run for run in outcomes if run[0] == a.url] == [
        (a.url, True, 2), (a.url, False, 1), (a.url, True, 1)
    ]  # fmt: skip
    assert [run for run in outcomes if run[0] == b.url] == [(b.url, True, 2)]
    assert pools.take_outcomes() == ()
