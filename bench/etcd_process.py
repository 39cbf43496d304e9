"""A single-member etcd on loopback for the benchmarks that run router replicas
(convert_under_load.py --replicas, replica_throughput.py).

The flags are those of tests/etcd_helpers.py (short heartbeat and election timeouts, so the
member elects itself in a few hundred milliseconds); this copy is a plain context manager
because the benchmarks run without pytest. The data dir is a temporary directory removed on
exit, so every run starts from an empty store.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pd_worker.cluster import LOOPBACK, free_port

READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


class EtcdStartError(RuntimeError):
    """etcd is not installed, exited, or did not report healthy in time."""


def etcd_argv(binary: str, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    """One member named ``bench`` serving clients on ``client_port`` of the loopback."""
    client = f"http://{LOOPBACK}:{client_port}"
    peer = f"http://{LOOPBACK}:{peer_port}"
    return [
        binary,
        "--name=bench",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=bench={peer}",
        "--heartbeat-interval=10",
        "--election-timeout=100",
        "--log-level=warn",
    ]


@contextlib.contextmanager
def running_etcd(binary: str = "etcd") -> Iterator[str]:
    """Start etcd (``binary`` on PATH or a path), yield its client url once ``/health`` says
    true, terminate it and remove its data on exit."""
    executable = shutil.which(binary)
    if executable is None:
        raise EtcdStartError(f"{binary!r} not found (Debian: apt-get install etcd-server)")
    with tempfile.TemporaryDirectory(prefix="pd-bench-etcd-") as tmp:
        log_path = Path(tmp) / "etcd.log"
        client_port = free_port()
        argv = etcd_argv(executable, Path(tmp) / "data", client_port, free_port())
        with log_path.open("wb") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://{LOOPBACK}:{client_port}"
        try:
            wait_healthy(url, process, log_path)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)


def wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise EtcdStartError(f"etcd exited with {process.returncode}: {tail}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if client.get(url + "/health").json().get("health") == "true":
                    return
            time.sleep(0.02)
    raise EtcdStartError(f"etcd not healthy within {READY_TIMEOUT_S:.0f}s")
