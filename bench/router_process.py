"""pd-router in its own process over a reference cluster, for the benchmarks that convert
workers through it (convert_under_load.py, rebalance.py): its TOML config (with a
``[cluster]`` section for a replica on etcd), start, readiness (every worker registered and
healthy) and stop."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pd_worker.cluster import WorkerCluster, free_port

REPO = Path(__file__).resolve().parent.parent
ROUTER_MAIN = "import sys; from pd_router.cli.main import main; sys.exit(main())"
ROUTER_START_TIMEOUT_S = 30.0
REPLICAS_READY_TIMEOUT_S = 30.0


def router_toml(
    port: int,
    prefill: dict[str, int],
    decode: list[str],
    *,
    drain_timeout_secs: float,
    extra: str = "",
    processes: int = 1,
) -> str:
    """The router's config: conversions allowed down to one worker per pool, one at a time,
    health probes every second, ``processes`` data planes, plus ``extra`` (more TOML)."""
    lines = [
        'host = "127.0.0.1"',
        f"port = {port}",
        'log_level = "warning"',
        "[conversion]",
        "min_prefill = 1",
        "min_decode = 1",
        "max_concurrent = 1",
        f"drain_timeout_secs = {drain_timeout_secs}",
        "[health]",
        "interval_secs = 1.0",
        "[server]",
        f"workers = {processes}",
    ]
    for url, bootstrap_port in prefill.items():
        lines += ["[[prefill]]", f'url = "{url}"', f"bootstrap_port = {bootstrap_port}"]
    for url in decode:
        lines += ["[[decode]]", f'url = "{url}"']
    return "\n".join(lines) + "\n" + extra


def cluster_toml(etcd_url: str, name: str) -> str:
    """A ``[cluster]`` section: the router joins cluster ``name`` on ``etcd_url`` as one of
    its replicas (the router's default lease TTL)."""
    return f'[cluster]\netcd = ["{etcd_url}"]\nname = "{name}"\n'


@contextlib.contextmanager
def running_router(
    cluster: WorkerCluster,
    *,
    drain_timeout_secs: float,
    extra: str = "",
    log_path: Path | None = None,
    processes: int = 1,
) -> Iterator[str]:
    """The router over ``cluster`` with ``processes`` data planes (its output to ``log_path``,
    else inherited); yields its url once every worker is healthy, stops it with SIGINT on
    exit."""
    port = free_port()
    prefill = {url: cluster.bootstrap_port(url) for url in cluster.prefill_urls}
    config = router_toml(
        port,
        prefill,
        cluster.decode_urls,
        drain_timeout_secs=drain_timeout_secs,
        extra=extra,
        processes=processes,
    )
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(config)
    argv = [sys.executable, "-c", ROUTER_MAIN, "serve", "--config", f.name]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with contextlib.ExitStack() as files:
        log = files.enter_context(log_path.open("wb")) if log_path is not None else None
        process = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT if log is not None else None
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, len(cluster.workers))
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        os.unlink(f.name)


def wait_ready(url: str, process: subprocess.Popen[bytes], workers: int) -> None:
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"router exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                listed = client.get(url + "/workers").json()["workers"]
                if len(listed) == workers and all(w["healthy"] for w in listed):
                    return
            time.sleep(0.05)
    raise SystemExit("router not ready in time")


def wait_replicas(urls: list[str]) -> None:
    """Return once every replica's ``GET /cluster`` lists all of them (each has joined and
    seen the others), polling for at most REPLICAS_READY_TIMEOUT_S."""
    deadline = time.monotonic() + REPLICAS_READY_TIMEOUT_S
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                views = [client.get(url + "/cluster").json() for url in urls]
                if all(view["etcd_up"] and len(view["replicas"]) == len(urls) for view in views):
                    return
            time.sleep(0.05)
    raise SystemExit(f"the {len(urls)} replicas did not all see each other in time")
