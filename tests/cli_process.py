"""The ``pd-router`` and ``pd-worker`` commands as an operator runs them: installed console
scripts in their own processes, real sockets, no admin key in the environment unless given.

    result = run(PD_ROUTER, "--port", "80x")          # a finished command
    line = one_line_error(result)                      # exit 2, one line, no traceback
    with serving(PD_ROUTER, "--prefill", url, ...) as router:
        router.url, router.log()                       # a router until SIGTERM
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx

from pd_worker.cluster import free_port

PD_ROUTER = str(Path(sys.executable).with_name("pd-router"))
PD_WORKER = str(Path(sys.executable).with_name("pd-worker"))
ADMIN_KEY_ENV = "PD_ROUTER_ADMIN_KEY"
START_TIMEOUT_SECS = 20.0
# Worker urls that nothing answers at: a router over them serves, its workers stay unhealthy.
NOWHERE = ("--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:7")


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without an admin key or router url, ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if k not in (ADMIN_KEY_ENV, "PD_ROUTER_URL")}
    return {**env, **(extra or {})}


def run(
    binary: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=timeout, env=environment(env)
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a user mistake prints; asserts exit status 2 and no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


class Served:
    """A running ``pd-router`` and its log so far."""

    def __init__(
        self, process: subprocess.Popen[bytes], port: int, log: tempfile._TemporaryFileWrapper
    ) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = log

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")


@contextlib.contextmanager
def serving(
    *args: str, env: Mapping[str, str] | None = None, port: int | None = None
) -> Iterator[Served]:
    """``pd-router ARGS --port PORT`` until it answers ``/liveness`` on loopback; SIGTERM on
    exit. ``args`` give everything else (workers, ``--host``)."""
    port = port or free_port()
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [PD_ROUTER, *args, "--port", str(port), "--log-format", "text"],
            stdout=log, stderr=subprocess.STDOUT, env=environment(env),
        )  # fmt: skip
        served = Served(process, port, log)
        try:
            wait_live(served)
            yield served
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def wait_live(served: Served) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECS
    while True:
        try:
            if httpx.get(served.url + "/liveness", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if served.process.poll() is not None:
            raise AssertionError(f"pd-router exited {served.process.returncode}: {served.log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"pd-router not live within {START_TIMEOUT_SECS}s: {served.log()}")
        time.sleep(0.05)
