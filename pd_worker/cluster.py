"""Start, inspect, kill and stop reference worker processes on free loopback ports.

Used by the test fixtures (``tests/conftest.py``), ``pd-worker cluster``, the demo and benchmarks.
Every worker is a real ``python -m pd_worker serve`` process with its own HTTP port and bootstrap
port on 127.0.0.1.

Synchronous use::

    with WorkerCluster(prefill=2, decode=2, speed=0.0) as c:
        c.prefill_urls          # ["http://127.0.0.1:41234", ...]
        c.decode_urls
        c.regular_urls          # workers launched with regular=N (--disaggregation-mode null)
        c.bootstrap_ports       # {url: bootstrap_port} for every worker
        c.bootstrap_port(url)   # one worker's bootstrap port
        c.kill(url)             # SIGKILL one worker (crash); c.terminate(url) for SIGTERM
        c.restart(url, "decode")  # SIGKILL it and start it again on its port (in another role)
        c.add("decode")         # start one more worker, returns its WorkerProcess

Asynchronous use (process start and health polling run in a thread)::

    async with WorkerCluster(prefill=1, decode=1, speed=0.0, max_running_requests=4) as c:
        ...

Keyword arguments besides the documented ones are timing knobs of
:class:`pd_worker.timing.TimingModel` (``speed``, ``max_total_num_tokens``,
``bootstrap_timeout_secs``, ...). Workers start with ``--enable-pd-role-switch`` and
``--enable-faults`` unless told otherwise; ``admin_api_key`` guards their admin routes;
``profile`` names a calibrated timing model (``h100-8b``) that the knobs then override;
``tls`` (:class:`ClusterTLS`) makes every worker serve HTTPS (mTLS with ``ca_certs``).
``engine`` picks the workers' data plane (``timing`` or ``torch``) and ``kv_transfer`` the torch
engine's KV transport (``mooncake`` or ``tcp``).
``etcd`` (a client url) with ``cluster_name`` makes every worker register itself in that router
cluster under a lease of ``etcd_lease_ttl`` seconds (docs/self-registration.md).
:func:`free_port` returns a free loopback TCP port.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from pd_worker.config import REGULAR_MODE
from pd_worker.timing import TimingModel

LOOPBACK = "127.0.0.1"
HEALTH_POLL_SECS = 0.05
STOP_TIMEOUT_SECS = 5.0
START_ATTEMPTS = 3
_KNOBS = {f.name for f in fields(TimingModel)}


class WorkerStartError(RuntimeError):
    """A worker process exited or did not become healthy in time."""


class WorkerExited(WorkerStartError):
    """A worker process exited while starting (e.g. its port was taken in the meantime)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class WorkerProcess:
    """One worker process and where to reach it."""

    role: str
    url: str
    port: int
    bootstrap_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class ClusterTLS:
    """HTTPS for every worker of a cluster: its certificate and key, and ``ca_certs`` to
    require client certificates signed by that CA (mTLS). The cluster's own health polls
    trust ``ca_certs`` (else the system store) and present ``client_cert``/``client_key``."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    def flags(self) -> tuple[str, ...]:
        ca = ("--ssl-ca-certs", self.ca_certs) if self.ca_certs else ()
        return ("--ssl-certfile", self.certfile, "--ssl-keyfile", self.keyfile, *ca)

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.client_cert is not None and self.client_key is not None:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context


class WorkerCluster:
    """A set of worker processes (see the module docstring for the API)."""

    def __init__(
        self,
        prefill: int = 1,
        decode: int = 1,
        *,
        regular: int = 0,
        speed: float = 0.0,
        base_port: int | None = None,
        host: str = LOOPBACK,
        enable_pd_role_switch: bool = True,
        enable_faults: bool = True,
        admin_api_key: str | None = None,
        profile: str | None = None,
        startup_timeout: float = 30.0,
        extra_args: tuple[str, ...] = (),
        tls: ClusterTLS | None = None,
        etcd: str | None = None,
        cluster_name: str | None = None,
        etcd_lease_ttl: int | None = None,
        engine: str = "timing",
        kv_transfer: str | None = None,
        **knobs: Any,
    ) -> None:
        unknown = set(knobs) - _KNOBS
        if unknown:
            raise TypeError(f"unknown timing knob(s): {', '.join(sorted(unknown))}")
        if (etcd is None) != (cluster_name is None):
            raise TypeError("etcd and cluster_name go together")
        self._initial = ("prefill",) * prefill + ("decode",) * decode + (REGULAR_MODE,) * regular
        self._knobs = dict(knobs, speed=speed)
        self._host = host
        self._base_port = base_port
        self._next_index = itertools.count()
        self._flags = (
            (("--enable-pd-role-switch",) if enable_pd_role_switch else ())
            + (("--enable-faults",) if enable_faults else ())
            + (("--admin-api-key", admin_api_key) if admin_api_key else ())
            + (("--profile", profile) if profile else ())
            + (tls.flags() if tls is not None else ())
            + _registration_flags(etcd, cluster_name, etcd_lease_ttl)
            + ("--engine", engine)
            + (("--kv-transfer", kv_transfer) if kv_transfer else ())
            + tuple(extra_args)
        )
        self._tls = tls
        self._scheme = "https" if tls is not None else "http"
        self.admin_api_key = admin_api_key
        self._startup_timeout = startup_timeout
        self._log_dir = Path(tempfile.mkdtemp(prefix="pd-worker-cluster-"))
        self._used_ports: set[int] = set()
        self.workers: list[WorkerProcess] = []

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> WorkerCluster:
        """Start the initial workers and wait until all are healthy."""
        try:
            self._launch(self._initial)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Terminate every worker (SIGTERM, then SIGKILL after a grace period)."""
        for worker in self.workers:
            if worker.alive:
                worker.process.send_signal(signal.SIGTERM)
        for worker in self.workers:
            try:
                worker.process.wait(STOP_TIMEOUT_SECS)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait(STOP_TIMEOUT_SECS)
        shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> WorkerCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> WorkerCluster:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    # ---------------------------------------------------------------- workers

    def add(self, role: str, **extra_knobs: Any) -> WorkerProcess:
        """Start one more worker of ``role`` and wait until it is healthy."""
        return self._launch((role,), extra_knobs)[0]

    def worker(self, url: str) -> WorkerProcess:
        for worker in self.workers:
            if worker.url == url:
                return worker
        raise KeyError(url)

    def kill(self, url: str) -> None:
        """SIGKILL one worker and reap it (a crash, as seen by the router)."""
        process = self.worker(url).process
        process.kill()
        process.wait(STOP_TIMEOUT_SECS)

    def terminate(self, url: str) -> None:
        """SIGTERM one worker and wait for it to exit (a graceful shutdown)."""
        process = self.worker(url).process
        process.terminate()
        process.wait(STOP_TIMEOUT_SECS)

    def restart(
        self, url: str, role: str | None = None, bootstrap_port: int | None = None
    ) -> WorkerProcess:
        """SIGKILL the worker at ``url`` and start a new process on the same HTTP port, in
        ``role`` (default: its launch role) with ``bootstrap_port`` (default: the same), as a
        supervisor restarts a crashed server; waits until it is healthy and returns it."""
        old = self.worker(url)
        self.kill(url)
        self.workers.remove(old)
        ports = (old.port, bootstrap_port or old.bootstrap_port)
        worker = self._spawn(role or old.role, ports=ports)
        self._wait_healthy(worker)
        return worker

    @property
    def urls(self) -> list[str]:
        return [w.url for w in self.workers]

    @property
    def prefill_urls(self) -> list[str]:
        """URLs of the workers launched as prefill (a role switch does not move them)."""
        return [w.url for w in self.workers if w.role == "prefill"]

    @property
    def decode_urls(self) -> list[str]:
        """URLs of the workers launched as decode."""
        return [w.url for w in self.workers if w.role == "decode"]

    @property
    def regular_urls(self) -> list[str]:
        """URLs of the regular (non-disaggregated) workers."""
        return [w.url for w in self.workers if w.role == REGULAR_MODE]

    @property
    def bootstrap_ports(self) -> dict[str, int]:
        return {w.url: w.bootstrap_port for w in self.workers}

    def bootstrap_port(self, url: str) -> int:
        return self.worker(url).bootstrap_port

    # ---------------------------------------------------------------- internals

    def _port(self, offset: int) -> int:
        if self._base_port is not None:
            return self._base_port + offset
        while True:
            port = free_port(self._host)
            if port not in self._used_ports:
                self._used_ports.add(port)
                return port

    def _spawn(
        self,
        role: str,
        extra_knobs: dict[str, Any] | None = None,
        ports: tuple[int, int] | None = None,
    ) -> WorkerProcess:
        index = next(self._next_index)
        port, bootstrap_port = ports or (self._port(index), self._port(1000 + index))
        knobs = dict(self._knobs, **(extra_knobs or {}))
        argv = [
            sys.executable, "-m", "pd_worker", "serve", "--role", role, "--host", self._host,
            "--port", str(port), "--bootstrap-port", str(bootstrap_port), "--log-level", "warning",
            "--parent-pid", str(os.getpid()), *self._flags,
        ]  # fmt: skip
        for name, value in knobs.items():
            argv += ["--" + name.replace("_", "-"), str(value)]
        log_path = self._log_dir / f"{role}-{index}.log"
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, env=_child_env()
            )
        worker = WorkerProcess(
            role, f"{self._scheme}://{self._host}:{port}", port, bootstrap_port, process, log_path
        )
        self.workers.append(worker)
        return worker

    def _launch(
        self, roles: tuple[str, ...], extra_knobs: dict[str, Any] | None = None
    ) -> list[WorkerProcess]:
        """Spawn workers of ``roles`` at once and wait until all are healthy.

        A free port is only free when it was looked up: another process can bind it before the
        worker does, and the worker then exits at start-up. Such a worker is started again on
        new ports (with ``base_port`` the ports are the caller's choice and are not changed)."""
        pending = [self._spawn(role, extra_knobs) for role in roles]
        ready: list[WorkerProcess] = []
        for attempt in range(1, START_ATTEMPTS + 1):
            exited: list[WorkerProcess] = []
            for worker in pending:
                try:
                    self._wait_healthy(worker)
                except WorkerExited:
                    if self._base_port is not None or attempt == START_ATTEMPTS:
                        raise
                    self.workers.remove(worker)
                    exited.append(worker)
                else:
                    ready.append(worker)
            if not exited:
                break
            pending = [self._spawn(worker.role, extra_knobs) for worker in exited]
        return ready

    def _wait_healthy(self, worker: WorkerProcess) -> None:
        deadline = time.monotonic() + self._startup_timeout
        verify = self._tls.client_context() if self._tls is not None else True
        with httpx.Client(timeout=1.0, verify=verify) as client:
            while time.monotonic() < deadline:
                if not worker.alive:
                    raise WorkerExited(
                        f"{worker.role} worker {worker.url} exited with "
                        f"{worker.process.returncode}: {worker.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(worker.url + "/health").status_code == 200:
                        return
                time.sleep(HEALTH_POLL_SECS)
        raise WorkerStartError(
            f"{worker.role} worker {worker.url} not healthy after {self._startup_timeout}s"
        )


def _registration_flags(
    etcd: str | None, cluster_name: str | None, lease_ttl: int | None
) -> tuple[str, ...]:
    if etcd is None or cluster_name is None:
        return ()
    ttl = ("--etcd-lease-ttl", str(lease_ttl)) if lease_ttl is not None else ()
    return ("--etcd", etcd, "--cluster", cluster_name, *ttl)


def _child_env() -> dict[str, str]:
    """The parent's environment, with this source tree importable even without an install."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
