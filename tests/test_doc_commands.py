"""The shell commands of README.md and docs/*.md run as written.

Every command of a ```bash block is either run here or matched by SKIPPED with the reason it
cannot run on this machine (Docker, GPUs, etcd at a fixed address, minutes-long benchmarks, the
test suite itself); a new command that fits neither fails this test. The commands of one block
run in order, as a reader would type them, against real processes:

- servers (``pd-worker serve``, ``pd-worker cluster``, ``pd-router`` serving, a command ending
  in ``&``, ``pd-router status --watch``) start in the background and must come up (answer
  ``/health``, print their workers, or still run after a moment); they stop with the block;
- ``export NAME=VALUE`` is run by bash and NAME kept for the block's later commands;
- every other command must exit 0 within COMMAND_TIMEOUT_SECS (curl: with a 2xx answer);
- a worker a router command names on a placeholder host (``http://p0:30000``) is started here
  as a reference worker in the role the command gives it, and a block that talks to a router
  it does not start gets one (1P1D) where it points.

Each port written in a block is replaced, throughout the block, by a free one (one per host and
port), and placeholder hosts by 127.0.0.1, so blocks run beside other tests; a server left on
its default port gets a free one the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pd_router.config import RouterConfig
from pd_worker.cluster import free_port
from pd_worker.config import DEFAULT_PORT as WORKER_DEFAULT_PORT

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND_TIMEOUT_SECS = 30.0
START_TIMEOUT_SECS = 40.0
WATCH_SECS = 1.5
ROUTER_DEFAULT_PORT = RouterConfig().port
LOCAL_HOSTS = {"localhost", "127.0.0.1", "0.0.0.0"}
# Hosts the docs use for machines of their own: each stands for one reference worker here.
PLACEHOLDER_HOSTS = re.compile(r"^[pd]\d$")
URL = re.compile(r"\b(?P<scheme>https?://)?(?P<host>[A-Za-z0-9.\-]+):(?P<port>\d{2,5})\b")
PORT_FLAG = re.compile(r"(--(?:port|bootstrap-port)[ =])(\d+)")

# (regular expression searched in the command, why it does not run here)
SKIPPED: list[tuple[str, str]] = [
    (
        r"^make (demo|test|install)\b",
        "installs into .venv and runs minutes (make test is this suite)",
    ),
    (r"^make bench", "a benchmark: minutes of load, figures in docs/PERFORMANCE.md"),
    (r"bench/\w+\.py", "a benchmark: minutes of load, figures in docs/PERFORMANCE.md"),
    (r"-m pytest", "the test suite itself"),
    (r"^docker\b", "needs a Docker engine"),
    (r"prefill-\d|decode-\d|router-\d", "addresses a service of a docker compose file"),
    (r"server_patch\.launch_server|^(MODEL|COMMON)=", "needs SGLang on GPUs"),
    (r"localhost:30003", "talks to the SGLang servers of the block before (GPU)"),
    (r"\$[AB]/", "talks to the real SGLang servers its text describes (tests/test_sglang_bugs.py)"),
    (r"^pip install|^python3\.11 -m venv|/pip install", "installs packages from the network"),
    (
        r"--etcd ",
        "needs an etcd at the address written (tests/test_worker_registration.py runs it)",
    ),
]
# ``export NAME=VALUE``: NAME is in the environment of the block's later commands.
EXPORT = re.compile(r"^export (?P<name>\w+)=")
# A block that only talks to a router assumes one at this address.
ASSUMED_ROUTER = re.compile(r"(?:localhost|127\.0\.0\.1):(\d+)")


@dataclass
class Command:
    doc: str
    text: str

    @property
    def skip_reason(self) -> str | None:
        return next((why for pattern, why in SKIPPED if re.search(pattern, self.text)), None)


def bash_blocks(path: Path) -> list[list[str]]:
    """The commands of each ```bash block: continuation lines joined, comments dropped."""
    blocks = []
    for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(), re.S | re.M):
        commands, pending = [], ""
        for line in block.splitlines():
            pending += line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            command = _without_comment(pending).strip()
            pending = ""
            if command:
                commands.append(" ".join(command.split()))
        blocks.append(commands)
    return blocks


def _without_comment(line: str) -> str:
    """The line up to a ``#`` that starts a shell comment (not one inside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def all_blocks() -> list[tuple[str, list[Command]]]:
    found = []
    for path in DOCS:
        name = str(path.relative_to(ROOT))
        for n, block in enumerate(bash_blocks(path)):
            found.append((f"{name}#{n + 1}", [Command(name, text) for text in block]))
    return found


BLOCKS = all_blocks()


@dataclass
class Ports:
    """Free ports standing for the ones a block writes, one per (host, port)."""

    mapped: dict[tuple[str, int], int] = field(default_factory=dict)

    def port(self, host: str, port: int) -> int:
        key = ("local" if host in LOCAL_HOSTS else host, port)
        if key not in self.mapped:
            self.mapped[key] = free_port()
        return self.mapped[key]

    def rewrite(self, text: str) -> str:
        def url(match: re.Match[str]) -> str:
            host, port = match["host"], int(match["port"])
            if host not in LOCAL_HOSTS and not PLACEHOLDER_HOSTS.match(host):
                return match[0]
            local = "127.0.0.1" if PLACEHOLDER_HOSTS.match(host) else host
            return f"{match['scheme'] or ''}{local}:{self.port(host, port)}"

        text = URL.sub(url, text)
        text = PORT_FLAG.sub(lambda m: m[1] + str(self.port("local", int(m[2]))), text)
        # mini_lb's "--prefill URL BOOTSTRAP_PORT": a bootstrap port of that prefill's own.
        return re.sub(
            r"(--prefill http://127\.0\.0\.1:(\d+)) (\d+)\b",
            lambda m: f"{m[1]} {self.port(f'bootstrap of {m[2]}', int(m[3]))}",
            text,
        )


@dataclass
class Block:
    """The processes one block started, stopped when it ends."""

    ports: Ports = field(default_factory=Ports)
    servers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    others: list[subprocess.Popen[bytes]] = field(default_factory=list)
    workers: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=lambda: environment())

    def export(self, command: str, name: str) -> None:
        """Run an ``export`` line as bash would and keep the variable for later commands."""
        done = subprocess.run(
            ["bash", "-c", f'{command}; printf %s "${name}"'], env=self.env, cwd=ROOT,
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_SECS,
        )  # fmt: skip
        assert done.returncode == 0 and done.stdout, f"{command}: {done.stderr}"
        self.env[name] = done.stdout

    def stop(self) -> None:
        processes = [*self.servers.values(), *self.others]
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def environment() -> dict[str, str]:
    """The venv's commands first on PATH, as after ``make install`` and activating .venv."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def spawn(block: Block, argv: list[str], **kwargs) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, env=block.env, cwd=ROOT, stdin=subprocess.DEVNULL, **kwargs
    )  # fmt: skip


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(process: subprocess.Popen[bytes], url: str, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECS
    while not answers(url):
        assert process.poll() is None, f"{what} exited with status {process.returncode}"
        assert time.monotonic() < deadline, f"{what} did not answer {url} in {START_TIMEOUT_SECS}s"
        time.sleep(0.1)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def start_worker(block: Block, role: str, port: int, bootstrap: int | None = None) -> None:
    argv = ["pd-worker", "serve", "--role", role, "--port", str(port), "--speed", "0",
            "--enable-pd-role-switch", "--log-level", "warning"]  # fmt: skip
    if bootstrap is not None:
        argv += ["--bootstrap-port", str(bootstrap)]
    process = spawn(block, argv)
    block.others.append(process)
    wait_for(process, f"http://127.0.0.1:{port}", f"worker {role} on {port}")
    block.workers[f"http://127.0.0.1:{port}"] = port


def router_workers(block: Block, argv: list[str]) -> None:
    """Start the workers a router command names that the block has not started (the docs'
    machines p0, d0, ...), in the role the command gives them."""
    for i, option in enumerate(argv[:-1]):
        url = argv[i + 1]
        if option not in ("--prefill", "--decode") or url in block.workers:
            continue
        given = argv[i + 2] if i + 2 < len(argv) else ""
        bootstrap = int(given) if option == "--prefill" and given.isdigit() else None
        start_worker(block, option.removeprefix("--"), int(url.rsplit(":", 1)[1]), bootstrap)


def serve(block: Block, command: str, written: str) -> None:
    """Start a server command in the background and wait until it is up."""
    argv = shlex.split(command.removesuffix("&").strip())
    program, sub = argv[0], argv[1] if len(argv) > 1 else ""
    if program == "pd-worker" and sub == "serve":
        if "--port" not in argv:
            argv += ["--port", str(block.ports.port("local", WORKER_DEFAULT_PORT))]
        port = int(flag(argv, "--port"))
        block.servers[port] = process = spawn(block, argv, stdout=subprocess.DEVNULL)
        wait_for(process, f"http://127.0.0.1:{port}", written)
        block.workers[f"http://127.0.0.1:{port}"] = port
    elif program == "pd-worker" and sub == "cluster":
        process = spawn(block, argv, stdout=subprocess.PIPE)
        block.others.append(process)
        expected = int(flag(argv, "--prefill") or 2) + int(flag(argv, "--decode") or 2)
        assert len(read_lines(process, expected)) == expected, written
    elif program == "pd-router" and "--watch" in argv:
        process = spawn(block, argv, stdout=subprocess.DEVNULL)
        block.others.append(process)
        time.sleep(WATCH_SECS)
        assert process.poll() is None, f"{written} exited with status {process.returncode}"
    else:
        router_workers(block, argv)
        if "--port" not in argv:
            argv += ["--port", str(block.ports.port("local", ROUTER_DEFAULT_PORT))]
        port = int(flag(argv, "--port"))
        earlier = block.servers.pop(port, None)
        if earlier is not None:
            earlier.terminate()
            earlier.wait(10)
        block.servers[port] = process = spawn(block, argv, stdout=subprocess.DEVNULL)
        wait_for(process, f"http://127.0.0.1:{port}", written)


def read_lines(process: subprocess.Popen[bytes], count: int) -> list[bytes]:
    """The first ``count`` lines the process prints, within START_TIMEOUT_SECS."""
    lines: list[bytes] = []

    def read() -> None:
        while len(lines) < count and (line := process.stdout.readline()):
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_SECS)
    return lines


def is_server(command: str) -> bool:
    argv = shlex.split(command.removesuffix("&").strip())
    if command.endswith("&") or "--watch" in argv:
        return True
    if argv[0] == "pd-worker":
        return argv[1] in ("serve", "cluster")
    if argv[0] == "pd-router":
        if {"--help", "--help-all", "--version"} & set(argv):
            return False
        return len(argv) == 1 or argv[1].startswith("-") or argv[1] == "serve"
    return False


def assumed_router(block: Block, written: list[str]) -> None:
    """A router (1P1D behind it) where a block that starts no server talks to one."""
    if any(is_server(command) and "--watch" not in command for command in written):
        return
    for written_port in {int(m[1]) for c in written for m in ASSUMED_ROUTER.finditer(c)}:
        port = block.ports.port("local", written_port)
        prefill, decode = free_port(), free_port()
        start_worker(block, "prefill", prefill)
        start_worker(block, "decode", decode)
        argv = ["pd-router", "--host", "127.0.0.1", "--port", str(port),
                "--prefill", f"http://127.0.0.1:{prefill}",
                "--decode", f"http://127.0.0.1:{decode}"]  # fmt: skip
        block.servers[port] = process = spawn(block, argv, stdout=subprocess.DEVNULL)
        wait_for(process, f"http://127.0.0.1:{port}", "the router the block assumes")


@contextlib.contextmanager
def running() -> Iterator[Block]:
    block = Block()
    try:
        yield block
    finally:
        block.stop()


def needs_torch(commands: list[Command]) -> bool:
    return any("--engine torch" in c.text for c in commands)


@pytest.mark.parametrize(
    "commands", [b for _, b in BLOCKS], ids=[name for name, _ in BLOCKS]
)  # fmt: skip
def test_doc_block_runs_as_written(commands):
    """A block with a command that cannot run here is skipped whole: its other commands build
    on that one (a loop's lines, a router in front of GPU servers)."""
    reasons = sorted({c.skip_reason for c in commands if c.skip_reason is not None})
    if reasons:
        pytest.skip("; ".join(reasons))
    if needs_torch(commands):
        pytest.importorskip("torch", reason="the torch engine needs the torch extra")
        pytest.importorskip("mooncake.engine", reason="the KV transport needs mooncake")
    with running() as block:
        assumed_router(block, [c.text for c in commands])
        texts = [block.ports.rewrite(c.text) for c in commands]
        for command, text in zip(commands, texts, strict=True):
            if exported := EXPORT.match(text):
                block.export(text, exported["name"])
                continue
            if is_server(text):
                serve(block, text, command.text)
                continue
            # curl exits 0 on any HTTP status unless told to fail on an error status.
            checked = re.sub(r"(^|[;|&] *)curl ", r"\1curl --fail-with-body ", text)
            done = subprocess.run(
                ["bash", "-c", checked], env=block.env, cwd=ROOT, capture_output=True,
                timeout=COMMAND_TIMEOUT_SECS, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            assert done.returncode == 0, (
                f"{command.text}\n(run as {text})\nexit {done.returncode}\n"
                f"{done.stdout.decode()[-2000:]}\n{done.stderr.decode()[-2000:]}"
            )
