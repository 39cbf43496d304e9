"""A router in its own process (``run_server``, the CLI's serving path: uvloop, raised open file
limit, the production listener), for tests that need what only a process has: its own
resource limits, its own resident memory in ``/proc``, its own file descriptor table.

    async with router_process(prefill=[url_p], decode=[url_d], nofile=512) as router:
        router.url, router.pid, router.rss_mb(), router.open_fds()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import orjson

from pd_worker.cluster import free_port
from tests.router_helpers import router_overrides, wait_until

START_TIMEOUT_SECS = 20.0
STOP_TIMEOUT_SECS = 10.0
ENTRY = (
    "import sys, orjson\n"
    "from pd_router.config import load_config\n"
    "from pd_router.cli.logs import configure_logging\n"
    "from pd_router.runtime.serve import run_server\n"
    "config = load_config(None, orjson.loads(sys.argv[1]))\n"
    "configure_logging(config.log_level, config.log_format)\n"
    "run_server(config)\n"
)


class RouterProcess:
    """A running router process and how to look at it."""

    def __init__(self, process: asyncio.subprocess.Process, port: int, log: Any) -> None:
        self.process = process
        self._log = log
        self.pid = process.pid
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def status_field(self, name: str) -> int:
        """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM, ...), in kB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
        raise KeyError(name)

    def rss_mb(self) -> float:
        return self.status_field("VmRSS") / 1024

    def peak_rss_mb(self) -> float:
        return self.status_field("VmHWM") / 1024

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def alive(self) -> bool:
        return self.process.returncode is None

    def log_text(self) -> str:
        """Everything the router logged so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 30.0)
        return httpx.AsyncClient(base_url=self.url, **kwargs)


def child_limits(nofile: int | None, cores: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that caps the child's open files (soft and hard) at ``nofile`` and
    runs it on ``cores`` only; None when neither is given."""
    if nofile is None and cores is None:
        return None

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        if cores is not None:
            os.sched_setaffinity(0, cores)

    return limit


async def ready(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(url + "/readiness")).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.asynccontextmanager
async def router_process(
    *,
    prefill: Sequence[str | tuple[str, int]],
    decode: Sequence[str],
    nofile: int | None = None,
    cores: set[int] | None = None,
    **overrides: Any,
) -> AsyncIterator[RouterProcess]:
    """A router process over these workers (fast health probes, ``overrides`` on top), ready
    to route (a healthy prefill and decode); stopped with SIGTERM on exit. ``nofile``: its
    open-file limit; ``cores``: the cores it may run on."""
    port = free_port()
    config = router_overrides(prefill, decode, **overrides)
    config["port"] = port
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", ENTRY, orjson.dumps(config).decode(),
            stdout=asyncio.subprocess.DEVNULL, stderr=log,
            preexec_fn=child_limits(nofile, cores),
        )  # fmt: skip
        router = RouterProcess(process, port, log)
        try:
            await wait_until(
                lambda: not router.alive() or ready(router.url), START_TIMEOUT_SECS, "ready"
            )
            if not router.alive():
                raise RuntimeError(f"router exited: {router.log_text()}")
            yield router
        finally:
            if router.alive():
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), STOP_TIMEOUT_SECS)
                except TimeoutError:
                    process.kill()
                    await process.wait()
