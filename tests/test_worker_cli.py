"""The ``pd-worker`` command line and the WorkerCluster process API."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest

from pd_worker.cluster import WorkerCluster

TIMEOUT = 10.0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pd_worker", *args], capture_output=True, text=True, timeout=TIMEOUT
    )


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--role", "sideways"),
        ("serve", "--port", "0"),
        ("serve", "--port", "9000", "--bootstrap-port", "9000"),
        ("serve", "--speed", "-1"),
        ("serve", "--max-running-requests", "0"),
        ("serve", "--profile", "tpu-1b"),
        ("cluster", "--prefill", "0", "--decode", "0"),
        ("frobnicate",),
    ],
)
def test_bad_arguments_print_one_line_and_exit_2(args):
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0]


def test_cluster_command_prints_urls_and_stops_its_workers_on_sigterm():
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pd_worker",
            "cluster",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--speed",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [process.stdout.readline() for _ in range(2)]
        roles = [line.split()[0] for line in lines]
        urls = [line.split()[1] for line in lines]
        assert roles == ["prefill", "decode"]
        assert all("bootstrap_port=" in line for line in lines)
        assert all(httpx.get(url + "/health").status_code == 200 for url in urls)
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")


def test_killing_one_worker_leaves_the_others_serving():
    with WorkerCluster(prefill=1, decode=2) as cluster:
        victim, survivor = cluster.decode_urls
        cluster.kill(victim)
        assert not cluster.worker(victim).alive
        with pytest.raises(httpx.ConnectError):
            httpx.get(victim + "/health")
        assert httpx.get(survivor + "/health").status_code == 200
        added = cluster.add("decode")
        assert httpx.get(added.url + "/health").status_code == 200
        assert added.url in cluster.decode_urls


async def test_cluster_is_usable_as_an_async_context_manager():
    async with (
        WorkerCluster(prefill=1, decode=1, max_running_requests=4) as cluster,
        httpx.AsyncClient(timeout=TIMEOUT) as client,
    ):
        load = (await client.get(cluster.decode_urls[0] + "/v1/loads")).json()
    assert load["loads"][0]["max_running_requests"] == 4


def test_unknown_timing_knob_is_a_type_error():
    with pytest.raises(TypeError, match="warp_speed"):
        WorkerCluster(warp_speed=9)


async def test_a_timing_profile_sets_the_knobs_that_are_not_given_explicitly():
    async with (
        WorkerCluster(prefill=0, decode=1, profile="h100-8b", max_running_requests=8) as cluster,
        httpx.AsyncClient(timeout=TIMEOUT) as client,
    ):
        load = (await client.get(cluster.decode_urls[0] + "/v1/loads")).json()["loads"][0]
    assert (load["max_total_num_tokens"], load["max_running_requests"]) == (557000, 8)
