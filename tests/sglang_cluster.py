"""Real SGLang 0.5.23 servers on the CPU, for the tests that prove the router against the real
thing (marker ``real_sglang``).

What it takes (all built once and cached outside the clone by ``make sglang-venv``, see
tests/sglang_cpu/build_venv.sh): SGLang's venv, with mooncake's non-CUDA transfer engine, and
a stand-in ``libcuda.so.1``; the tiny Llama of tests/sglang_cpu/make_model.py (seeded real
weights, a tokenizer trained here). The CPU shims (the stub library,
tests/sglang_cpu/cpu_shim/sitecustomize.py) are test support, never part of what a GPU user
runs. When the venv is missing or the machine has
too little memory for the servers, the tests skip and say why.

A server is one ``python -m sglang.launch_server`` (or ``server_patch.launch_server``) process
group with the CPU flags of :data:`CPU_FLAGS`, forked from one process that imported SGLang once
(:class:`ForkServer`); PD servers run mooncake's TCP transport on loopback and each has its own
bootstrap port (with ``--enable-pd-role-switch`` every instance runs a bootstrap server, decodes
too). Servers die with the test process (``PR_SET_PDEATHSIG``) and are stopped as a process
group.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pd_worker.cluster import free_port

SGLANG_VERSION = "0.5.23"
REPO = Path(__file__).resolve().parents[1]
SUPPORT = REPO / "tests" / "sglang_cpu"
CACHE = Path(os.environ.get("PD_ROUTER_CACHE", Path.home() / ".cache" / "pd-router"))
VENV = CACHE / f"sglang-{SGLANG_VERSION}"
# Per server: about 1-1.6 GB resident once warm (its scheduler and launcher), more while it starts.
MEMORY_PER_SERVER_GB = 2.0
# Six servers start in 2-3 minutes on 2 cores; much longer only when the machine is shared.
READY_TIMEOUT_SECS = 600.0
READY_LINE = "The server is fired up and ready to roll!"
# A server started beside others can lose its port to one of their own (SGLang picks its
# internal ports itself): it logs this and never gets ready, so it is started again elsewhere.
PORT_TAKEN = "error while attempting to bind on address"
RESTARTS = 2
# SGLang's /health runs a one-token generation (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is on
# by default), so a router's health probe keeps an idle server busy for a moment: a switch then
# is refused as "not idle" (safe_to_restore) and the caller tries again, as the router does.
NOT_IDLE = "instance is not idle"
SWITCH_RETRY_SECS = 30.0
CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--sleep-on-idle", "--disable-overlap-schedule",
    "--max-total-tokens", "4096", "--tp", "1", "--enable-metrics",
)  # fmt: skip
PD_FLAGS = (
    "--disaggregation-transfer-backend", "mooncake_tcp",
    "--disaggregation-decode-retraction-backup", "cpu_tensor",
    "--enable-pd-role-switch",
)  # fmt: skip
# SGLang 0.5.23 crashes a server with a radix cache after prefill -> decode (docs/sglang-bugs.md):
# every plain switchable server of the shared fleet runs without one; the server_patch ones keep
# it, as docs/server_patch.md advises (tests/test_sglang_bugs.py proves the patch on them).
NO_RADIX = ("--disable-radix-cache",)


def missing() -> str | None:
    """Why real SGLang cannot run here, or None when it can."""
    if not (VENV / ".complete").exists():
        return f"no SGLang venv at {VENV} (make sglang-venv builds it: ~11 GB, 3-5 minutes)"
    return None


def require(servers: int) -> None:
    """Skip unless the venv is built and the machine has memory for ``servers`` servers."""
    if reason := missing():
        pytest.skip(reason)
    available_gb = available_memory_gb()
    if available_gb < servers * MEMORY_PER_SERVER_GB:
        pytest.skip(
            f"{servers} real SGLang servers need about {servers * MEMORY_PER_SERVER_GB:.0f} GB of "
            f"free memory; {available_gb:.1f} GB free"
        )


def available_memory_gb() -> float:
    """MemAvailable: free memory plus what the kernel would give back from its caches."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def tiny_model() -> Path:
    """The tiny Llama's checkpoint directory, written once per version of its generator."""
    script = SUPPORT / "make_model.py"
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    target = CACHE / f"tiny-llama-{digest}"
    if not (target / "config.json").exists():
        subprocess.run([str(VENV / "bin" / "python"), str(script), str(target)], check=True)
    return target


# SGLang 0.5.23 holds the KV of a decode request aborted before its transfer ended until the
# prefill acknowledges the abort, or this many seconds (its default 30): a request stuck at a
# stale endpoint (bug b) is acknowledged by no one, and meanwhile the decode refuses every switch
# as not idle while its /v1/loads and /pd_role read idle. A transfer of the tiny model's KV on
# loopback takes milliseconds, so a few seconds still outlast any real one.
DEFERRED_KV_RELEASE_SECS = 5
# When a scheduler dies (SIGTERM to a server's process group, bug a's crash), SGLang's launcher
# sleeps 5 s "to let GPU activity settle" before py-spy and CUDA core dumps; on the CPU it then
# finds nothing to dump. Both dumps off, it stops at once.
NO_CRASH_DIAGNOSTICS = {
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
}


def environment() -> dict[str, str]:
    """SGLang on the CPU: its CPU engine, the stub libcuda, the import-time shim, loopback
    addresses for bootstrap, ZMQ and mooncake, one torch thread per server (several servers
    share two cores; one count everywhere keeps outputs identical across servers), the
    deferred KV release of :data:`DEFERRED_KV_RELEASE_SECS`, no crash diagnostics."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA", "PYTHON"))}
    env |= {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_HOST_IP": "127.0.0.1",
        "LD_LIBRARY_PATH": str(VENV / "cpu-shim"),
        "PYTHONPATH": os.pathsep.join([str(SUPPORT / "cpu_shim"), str(REPO)]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(DEFERRED_KV_RELEASE_SECS),
        **NO_CRASH_DIAGNOSTICS,
    }
    return env


def _die_with_parent() -> None:
    """In the child before exec: a new process group, and SIGTERM when the test process dies."""
    os.setsid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def running_pid(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie its parent has yet to reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class ForkServer:
    """tests/sglang_cpu/forkserver.py: one process of SGLang's venv that imports SGLang once and
    forks every server from there. A server's start on the CPU is mostly its imports, the same
    for every server; forked, the fleet of six pays them once (test support only, like the rest
    of tests/sglang_cpu/). It dies with the test process, its servers with it."""

    def __init__(self, log_dir: Path) -> None:
        self._log = (log_dir / "forkserver.log").open("wb")
        self.process = subprocess.Popen(
            [str(VENV / "bin" / "python"), str(SUPPORT / "forkserver.py")], cwd=log_dir,
            env=environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        self.log_path = log_dir / "forkserver.log"

    def launch(self, module: str, args: Sequence[str], log: Path, cwd: Path) -> int:
        """``python -m MODULE ARGS`` with its output on ``log``, in a process group of its own;
        its pid. The first call waits until the fork server has imported SGLang."""
        assert self.process.stdin is not None and self.process.stdout is not None
        log.write_bytes(b"")  # there to be read from now on, written by the server once forked
        request = {"module": module, "args": list(args), "log": str(log), "cwd": str(cwd)}
        with contextlib.suppress(BrokenPipeError):  # a fork server gone says so below
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            log_text = self.log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"SGLang's fork server exited:\n{log_text}")
        return int(json.loads(line)["pid"])

    def close(self) -> None:
        """Ends the fork server (its servers are stopped before)."""
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


@dataclass
class SGLangServer:
    """One real SGLang server: ``mode`` prefill, decode or None (colocated, no PD)."""

    name: str
    mode: str | None
    port: int
    bootstrap_port: int | None
    patched: bool = False
    extra: Sequence[str] = ()
    pid: int | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def entry(self) -> str:
        """The module run as ``python -m``."""
        return "server_patch.launch_server" if self.patched else "sglang.launch_server"

    def arguments(self, model: Path) -> list[str]:
        """The command line after ``python -m ENTRY``."""
        args = ["--model-path", str(model), "--host", "127.0.0.1", "--port", str(self.port)]
        args += CPU_FLAGS
        if self.mode is not None:
            args += ["--disaggregation-mode", self.mode, *PD_FLAGS]
            args += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        return args + list(self.extra)

    def start(self, model: Path, log_dir: Path, forks: ForkServer) -> SGLangServer:
        self.log_path = log_dir / f"{self.name}.log"
        self.pid = forks.launch(self.entry, self.arguments(model), self.log_path, log_dir)
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def alive(self) -> bool:
        return self.pid is not None and running_pid(self.pid)

    def port_taken(self) -> bool:
        return PORT_TAKEN in self.log_text()

    def ready(self) -> bool:
        if READY_LINE not in self.log_text():
            return False
        try:
            return httpx.get(self.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def send(self, sig: int) -> None:
        """``sig`` to the whole process group (the launcher, its scheduler and detokenizer)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stops the whole process group: ``sig``, then SIGKILL after ``timeout``."""
        if self.pid is None:
            return
        self.send(sig)
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.send(signal.SIGKILL)
        while self.alive():
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL to the whole group, as a crash or an OOM kill would end it."""
        self.stop(signal.SIGKILL)

    def role(self) -> str:
        """The role SGLang's scheduler runs now (its ``/server_info``)."""
        info = httpx.get(self.url + "/server_info", timeout=10.0).json()
        return str(info["internal_states"][0]["disaggregation_mode"])

    def switch(self, role: str, timeout: float = 120.0) -> dict[str, object]:
        """SGLang's own ``/pd_role_switch`` to ``role``, tried again while the server answers
        that it is not idle (a health probe's generation); any other refusal is returned."""
        body: dict[str, object] = {"new_role": role}
        if role == "decode":
            body["decode_cuda_graph_memory_gb"] = 0
        deadline = time.monotonic() + SWITCH_RETRY_SECS
        while True:
            reply = httpx.post(self.url + "/pd_role_switch", json=body, timeout=timeout).json()
            if NOT_IDLE not in str(reply.get("message")) or time.monotonic() > deadline:
                return reply
            time.sleep(0.2)


def server(name: str, mode: str | None, *, patched: bool = False, extra=()) -> SGLangServer:
    """A server description on free ports (a bootstrap port for PD servers)."""
    bootstrap = free_port() if mode is not None else None
    return SGLangServer(name, mode, free_port(), bootstrap, patched, tuple(extra))


def wait_ready(
    servers: Sequence[SGLangServer],
    restart: Callable[[SGLangServer], None],
    timeout: float = READY_TIMEOUT_SECS,
) -> None:
    """Until every server answers; a server whose port was taken is restarted on others (at
    most :data:`RESTARTS` times in all); one that exits or stays silent fails with its log."""
    deadline = time.monotonic() + timeout
    waiting = list(servers)
    restarts = 0
    while waiting:
        for s in list(waiting):
            if s.port_taken() and restarts < RESTARTS:
                restarts += 1
                restart(s)
                continue
            if not s.alive():
                raise RuntimeError(f"SGLang server {s.name} exited:\n{s.log_text()[-4000:]}")
            if s.ready():
                waiting.remove(s)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            raise RuntimeError(f"SGLang servers not ready in {timeout:.0f} s: {names}")
        time.sleep(0.5)


@contextlib.contextmanager
def running(servers: Sequence[SGLangServer]) -> Iterator[list[SGLangServer]]:
    """Starts ``servers`` together (their start-ups overlap), yields them ready, stops them."""
    require(len(servers))
    model = tiny_model()
    log_dir = Path(tempfile.mkdtemp(prefix="sglang-"))

    forks = ForkServer(log_dir)

    def restart(s: SGLangServer) -> None:
        s.kill()
        s.port = free_port()
        if s.bootstrap_port is not None:
            s.bootstrap_port = free_port()
        s.start(model, log_dir, forks)

    try:
        for s in servers:
            s.start(model, log_dir, forks)
        wait_ready(servers, restart)
        yield list(servers)
    finally:
        for s in servers:
            s.send(signal.SIGTERM)
        for s in servers:
            s.stop()
        forks.close()


def pd_args(prefill: Sequence[SGLangServer], decode: Sequence[SGLangServer]) -> list[str]:
    """``pd-router`` arguments naming these workers as mini_lb's command line does."""
    args: list[str] = []
    for p in prefill:
        args += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decode:
        args += ["--decode", d.url]
    return args


def router_ready(url: str, *, prefill: int, decode: int, timeout: float = 60.0) -> None:
    """Until the router at ``url`` can pick among ``prefill`` and ``decode`` workers (its other
    pools, if any, are no concern of a PD fleet)."""
    deadline = time.monotonic() + timeout
    want = {"prefill": prefill, "decode": decode}
    while True:
        try:
            selectable = httpx.get(url + "/workers", timeout=5.0).json()["selectable"]
            if {role: selectable.get(role) for role in want} == want:
                return
        except httpx.HTTPError:
            selectable = None
        if time.monotonic() > deadline:
            raise AssertionError(f"router pools {selectable}, want {want}")
        time.sleep(0.2)


def eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Until ``check()`` holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.2)


@dataclass
class Fleet:
    """The shared real-SGLang servers: a colocated reference (same weights, no PD) and a 2P2D
    whose second prefill and decode run through server_patch with the radix cache on (the router
    speaks the extension protocol to those and SGLang's native one to the others). Tests that
    convert put every server back in its first role before they end."""

    reference: SGLangServer
    prefill: list[SGLangServer]
    decode: list[SGLangServer]
    # Plain SGLang with its radix cache (SGLang's default), in no pool of router_args(): the
    # server that dies of bug a, for the tests that end the fleet (marker ends_the_fleet).
    radix_prefill: SGLangServer

    @property
    def pd(self) -> list[SGLangServer]:
        return self.prefill + self.decode

    def router_args(self) -> list[str]:
        return pd_args(self.prefill, self.decode)

    def restore_roles(self) -> list[str]:
        """Switches every living PD server that left its first role back to it; says which
        (none when the tests kept their promise)."""
        moved = []
        for s in self.pd:
            if s.alive() and s.role() != s.mode:
                reply = s.switch(str(s.mode))
                assert reply.get("success"), (s.name, reply)
                moved.append(s.name)
        return moved

    def refresh_decodes(self) -> None:
        """Takes every decode around a round trip of its own (decode -> prefill -> decode), the
        one thing that clears the prefill endpoints SGLang 0.5.23 caches (bug b): after a test
        took a prefill around a round trip, the decodes that talked to it before keep its old
        endpoint, and the tests after it would meet that stale pair."""
        for s in self.decode:
            for role in ("prefill", "decode"):
                reply = s.switch(role)
                assert reply.get("success"), (s.name, reply)


@pytest.fixture(scope="session")
def sglang_fleet() -> Iterator[Fleet]:
    """Six real SGLang servers for the whole session (about 30 s to start on 2 cores, each
    forked from one process that imported SGLang, their schedulers forked too:
    tests/sglang_cpu/forkserver.py, tests/sglang_cpu/cpu_shim/sitecustomize.py)."""
    reference = server("colocated", None, extra=NO_RADIX)
    prefill = [server("p0", "prefill", extra=NO_RADIX), server("p1", "prefill", patched=True)]
    decode = [server("d0", "decode", extra=NO_RADIX), server("d1", "decode", patched=True)]
    radix_prefill = server("p-radix", "prefill")
    with running([reference, *prefill, *decode, radix_prefill]):
        yield Fleet(reference, prefill, decode, radix_prefill)


@pytest.fixture(autouse=True)
def fleet_roles_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the shared fleet: every server is in its first role again. A test that
    left one moved errors here, and the servers are switched back so that the tests after it
    meet the 2P2D they expect rather than fail one after another."""
    yield
    if "sglang_fleet" not in request.fixturenames:
        return
    moved = request.getfixturevalue("sglang_fleet").restore_roles()
    assert not moved, f"the test left {moved} in another role (switched back)"
