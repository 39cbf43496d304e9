"""Health probes and circuit breakers: transitions seen through the router's pools, readiness
and request outcomes, against real reference workers."""

from __future__ import annotations

import logging
import socket

import httpx

from pd_router.control.workers import Role
from pd_worker.cluster import WorkerCluster
from tests.fault_cluster import clear_faults, module_cluster  # noqa: F401 (fixtures)
from tests.router_helpers import assert_paired, fault, generate_body, running_router, wait_until

TOKENS = 3


cluster = module_cluster(prefill=1, decode=1, speed=0.0)


async def test_failing_health_probes_take_a_worker_out_and_back(cluster):
    decode = cluster.decode_urls[0]
    async with running_router(cluster) as router, router.client() as http:
        worker = router.state.registry.get(decode)
        await fault(decode, unhealthy=True)
        await wait_until(lambda: not worker.healthy, 5.0, "decode marked unhealthy")
        assert (await http.get("/readiness")).status_code == 503
        refused = await http.post("/generate", json=generate_body("x", TOKENS))
        assert refused.status_code == 503
        assert refused.headers["Retry-After"]
        await fault(decode, unhealthy=False)
        await wait_until(lambda: worker.healthy, 5.0, "decode healthy again")
        assert (await http.get("/readiness")).status_code == 200
        served = await http.post("/generate", json=generate_body("back", TOKENS))
        assert_paired(served.json(), "back", TOKENS)


async def test_one_failed_probe_does_not_flap_the_pool(cluster):
    async with running_router(
        cluster, health={"interval_secs": 30.0, "failure_threshold": 2}
    ) as router:
        worker = router.state.registry.get(cluster.decode_urls[0])
        await fault(worker.url, unhealthy=True)
        await router.state.health.check(worker)
        assert worker.healthy
        await router.state.health.check(worker)
        assert not worker.healthy


def free_port_pair() -> int:
    """A port p with p and p + 1000 both free (a worker's HTTP and bootstrap ports)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        if port + 1000 > 65535:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 1000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


async def test_worker_down_at_startup_is_unhealthy_then_picked_up(cluster):
    port = free_port_pair()
    late = f"http://127.0.0.1:{port}"
    async with (
        running_router(cluster, prefill=[late]) as router,
        router.client() as http,
    ):
        worker = router.state.registry.get(late)
        assert not worker.healthy
        assert worker.bootstrap_port is None
        assert (await http.get("/readiness")).status_code == 503
        with WorkerCluster(prefill=1, decode=0, base_port=port) as late_cluster:
            await wait_until(lambda: worker.healthy, 10.0, "late prefill healthy")
            assert worker.bootstrap_port == late_cluster.bootstrap_port(late)
            response = await http.post("/generate", json=generate_body("late", TOKENS))
            assert assert_paired(response.json(), "late", TOKENS) == late


async def test_prefill_bootstrap_port_comes_from_server_info_unless_given(cluster):
    prefill = cluster.prefill_urls[0]
    async with running_router(cluster) as router:
        discovered = router.state.registry.get(prefill).bootstrap_port
        assert discovered == cluster.bootstrap_port(prefill)
    async with running_router(cluster, prefill=[(prefill, discovered)]) as router:
        assert router.state.registry.get(prefill).bootstrap_port == discovered


async def test_bootstrap_port_a_prefill_reports_wins_over_a_wrong_one_given_with_a_warning(
    cluster, caplog
):
    caplog.set_level(logging.WARNING, logger="pd_router.control.health")
    prefill = cluster.prefill_urls[0]
    real = cluster.bootstrap_port(prefill)
    given = real + 1
    async with running_router(cluster, prefill=[(prefill, given)]) as router:
        worker = router.state.registry.get(prefill)
        await wait_until(lambda: worker.bootstrap_port == real, 5.0, "the reported port used")
        async with router.client() as http:
            response = await http.post("/generate", json=generate_body("right port", TOKENS))
        assert assert_paired(response.json(), "right port", TOKENS) == prefill
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"prefill {prefill} reports bootstrap port {real}, not {given}; using {real}" in warnings


async def test_circuit_opens_on_failures_and_closes_after_a_good_trial(cluster):
    decode = cluster.decode_urls[0]
    async with (
        running_router(
            cluster,
            health={"interval_secs": 30.0},
            circuit={"failure_threshold": 2, "cooldown_secs": 0.3},
        ) as router,
        router.client() as http,
    ):
        worker = router.state.registry.get(decode)
        await fault(decode, fail_next=2, fail_status=500)
        for _ in range(2):
            assert (
                await http.post("/generate", json=generate_body("f", TOKENS))
            ).status_code == 502
        await wait_until(lambda: worker.circuit.state.value == "open", 5.0, "circuit open")
        assert worker not in router.state.registry.selectable(Role.DECODE)
        metrics = (await http.get("/metrics")).text
        assert f'pd_router_circuit_state{{worker="{decode}"}} 1.0' in metrics
        await wait_until(lambda: worker.circuit.state.value == "half_open", 5.0, "half-open")
        trial = await http.post("/generate", json=generate_body("trial", TOKENS))
        assert_paired(trial.json(), "trial", TOKENS)
        await wait_until(lambda: worker.circuit.state.value == "closed", 5.0, "circuit closed")


async def test_failed_half_open_trial_opens_the_circuit_again(cluster):
    decode = cluster.decode_urls[0]
    async with (
        running_router(
            cluster,
            health={"interval_secs": 30.0},
            circuit={"failure_threshold": 1, "cooldown_secs": 0.2},
        ) as router,
        router.client() as http,
    ):
        worker = router.state.registry.get(decode)
        await fault(decode, fail_next=2, fail_status=500)
        await http.post("/generate", json=generate_body("f", TOKENS))
        await wait_until(lambda: worker.circuit.state.value == "half_open", 5.0, "half-open")
        assert (await http.post("/generate", json=generate_body("f", TOKENS))).status_code == 502
        await wait_until(lambda: worker.circuit.state.value == "open", 5.0, "circuit open again")


async def test_client_errors_do_not_count_against_the_circuit(cluster):
    decode = cluster.decode_urls[0]
    async with (
        running_router(cluster, circuit={"failure_threshold": 1}) as router,
        router.client() as http,
    ):
        await fault(decode, fail_next=3, fail_status=400)
        for _ in range(3):
            assert (
                await http.post("/generate", json=generate_body("f", TOKENS))
            ).status_code == 400
        assert router.state.registry.get(decode).circuit.state.value == "closed"


TO_DECODE = {"new_role": "decode", "decode_cuda_graph_memory_gb": 0.6}


async def test_worker_restarted_in_its_launch_role_rejoins_that_pool(cluster):
    port = free_port_pair()
    url = f"http://127.0.0.1:{port}"
    with WorkerCluster(prefill=1, decode=0, base_port=port) as converted:
        async with httpx.AsyncClient(timeout=10.0) as control:
            switched = await control.post(url + "/pd_role_switch", json=TO_DECODE)
        assert switched.json()["success"]
        async with running_router(cluster, decode=[*cluster.decode_urls, url]) as router:
            worker = router.state.registry.get(url)
            assert worker.role is Role.DECODE and worker.healthy
            converted.kill(url)
            await wait_until(lambda: not worker.healthy, 5.0, "crashed worker unhealthy")
            with WorkerCluster(prefill=1, decode=0, base_port=port) as restarted:
                await wait_until(lambda: worker.healthy, 10.0, "restarted worker healthy")
                assert worker.role is Role.PREFILL
                assert worker.bootstrap_port == restarted.bootstrap_port(url)
                assert worker in router.state.registry.selectable(Role.PREFILL)
                assert worker not in router.state.registry.selectable(Role.DECODE)


async def test_restarted_worker_without_extensions_is_placed_by_its_server_info(cluster):
    port = free_port_pair()
    url = f"http://127.0.0.1:{port}"
    with WorkerCluster(prefill=0, decode=1, base_port=port) as first:
        async with running_router(
            cluster,
            decode=[*cluster.decode_urls, url],
            health={"interval_secs": 60.0, "failure_threshold": 1, "success_threshold": 1},
        ) as router:
            worker = router.state.registry.get(url)
            first.kill(url)
            assert not await router.state.health.check(worker)
            with WorkerCluster(prefill=1, decode=0, base_port=port) as restarted:
                await fault(url, native_only=True)
                assert await router.state.health.check(worker)
                assert worker.has_extensions is False
                assert worker.role is Role.PREFILL
                assert worker.bootstrap_port == restarted.bootstrap_port(url)
