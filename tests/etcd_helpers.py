"""A real single-member etcd on loopback for tests (Debian's ``etcd-server``, see ``make browser``).

``etcd_server`` (function scope) yields a started :class:`EtcdServer` on free ports with a
temporary data dir; tests that use it skip with the reason when no ``etcd`` binary is installed.
The server can be stopped and started again on the same ports and data, so a test can take etcd
away from a client and give it back with its revisions intact, or frozen for a while
(``stalled``). Short heartbeat and election
timeouts make the single member elect itself in a few hundred milliseconds.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pd_worker.cluster import LOOPBACK, free_port

ETCD = shutil.which("etcd")
requires_etcd = pytest.mark.skipif(
    ETCD is None,
    reason="etcd not installed (Debian: apt-get install etcd-server; `make test` does it as root)",
)
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0


class EtcdDidNotStart(RuntimeError):
    """etcd exited or did not report healthy in time; carries the tail of its log."""


@dataclass
class EtcdServer:
    """One etcd member: ``url`` is its client endpoint; ``start``/``stop`` may repeat."""

    binary: str
    data_dir: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / "etcd.log"

    def _command(self) -> list[str]:
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        return [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            "--log-level=warn",
        ]

    def start(self) -> EtcdServer:
        """Start etcd and return once its /health reports true (raises EtcdDidNotStart)."""
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EtcdDidNotStart(f"etcd exited {self.process.returncode}: {self._log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.02)
        self.stop()
        raise EtcdDidNotStart(f"etcd not healthy within {READY_TIMEOUT_S}s: {self._log_tail()}")

    def stop(self) -> None:
        """Terminate etcd (kill if it lingers); the data dir stays for a later ``start``."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def healthy(self) -> bool:
        """Whether etcd answers its /health now (within a second) and reports healthy."""
        conn = http.client.HTTPConnection(LOOPBACK, self.client_port, timeout=1.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            return response.status == 200 and json.loads(response.read()).get("health") == "true"
        except (OSError, ValueError):
            return False
        finally:
            conn.close()

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """etcd frozen (SIGSTOP) inside the block, as a slow disk or a stuck leader leave it:
        connections are accepted and nothing is answered; it resumes (SIGCONT) on exit, and
        then expires every lease whose TTL ran out meanwhile."""
        assert self.process is not None, "etcd is not running"
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    if ETCD is None:
        pytest.skip(requires_etcd.kwargs["reason"])
    with tempfile.TemporaryDirectory(prefix="pd-etcd-") as tmp:
        server = EtcdServer(binary=ETCD, data_dir=Path(tmp) / "data")
        try:
            yield server.start()
        finally:
            server.stop()
