"""The routers compared by bench/overhead.py, and their private virtual environments.

Peers are installed from PyPI into git-ignored venvs under bench/venvs/ so that their
dependencies (FastAPI, uvicorn, grpcio, ...) never leak into the project's .venv and the
comparison runs on any fresh machine with Python 3.11 and network access to PyPI.

    python bench/peers.py setup            # create/refresh every peer venv
    python bench/peers.py setup smg        # only one
    python bench/peers.py check            # run each peer's --help once
    python bench/peers.py setup smg py-spy --python python3 --wheels DIR   # offline, from wheels

`ensure_py_spy()` does the same for the profiler (bench/venvs/tools). `--wheels DIR` installs
from a folder of wheels instead of PyPI (`pip download` them elsewhere), for a machine with
no network.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENVS = REPO / "bench" / "venvs"
PROJECT_VENV = REPO / ".venv"
TOOLS_VENV = VENVS / "tools"
INSTALL_TIMEOUT_S = 1200.0
PY_SPY = "py-spy"
HELP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Topology:
    """Where the workers listen: prefill (url, bootstrap port) pairs and decode urls."""

    prefills: tuple[tuple[str, int], ...]
    decodes: tuple[str, ...]


def free_port(host: str = "127.0.0.1") -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


ArgvBuilder = Callable[[Path, Topology, str, int], list[str]]


@dataclass(frozen=True)
class Peer:
    """One router under test: how to install it and how to start it in front of a topology."""

    name: str
    venv_name: str | None
    packages: tuple[str, ...]
    build_argv: ArgvBuilder
    help_argv: tuple[str, ...]
    description: str

    @property
    def venv(self) -> Path:
        """The venv the peer runs from: its own under bench/venvs, or the project's .venv."""
        return PROJECT_VENV if self.venv_name is None else VENVS / self.venv_name

    def argv(self, topology: Topology, host: str, port: int) -> list[str]:
        """The command line that starts this router on host:port in front of topology."""
        return self.build_argv(self.venv / "bin", topology, host, port)


def _worker_flags(topology: Topology) -> list[str]:
    """The `--prefill URL PORT ... --decode URL ...` flags every PD router here understands."""
    flags: list[str] = []
    for url, bootstrap_port in topology.prefills:
        flags += ["--prefill", url, str(bootstrap_port)]
    for url in topology.decodes:
        flags += ["--decode", url]
    return flags


def _pd_router_argv(bin_dir: Path, topology: Topology, host: str, port: int) -> list[str]:
    """pd-router with its defaults (least_inflight on both pools), quiet logs."""
    return [
        str(bin_dir / "pd-router"),
        *_worker_flags(topology),
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warn",
    ]


def _mini_lb_argv(bin_dir: Path, topology: Topology, host: str, port: int) -> list[str]:
    """sglang-router's Python mini_lb (random policy, uvicorn; ignores --log-level)."""
    return [
        str(bin_dir / "python"),
        "-m",
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--mini-lb",
        *_worker_flags(topology),
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warn",
    ]


def _smg_argv(bin_dir: Path, topology: Topology, host: str, port: int) -> list[str]:
    """smg (Rust) in PD mode; round_robin keeps its policy as cheap as ours.

    Its metrics listener defaults to 0.0.0.0:29000; it is moved to a free loopback port.
    """
    return [
        str(bin_dir / "smg"),
        "launch",
        "--pd-disaggregation",
        *_worker_flags(topology),
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--disable-tokenizer-autoload",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(free_port(host)),
        "--log-level",
        "warn",
    ]


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        Peer(
            name="pd-router",
            venv_name=None,
            packages=(),
            build_argv=_pd_router_argv,
            help_argv=("pd-router", "--help"),
            description="this repo (make install), least_inflight",
        ),
        Peer(
            name="mini_lb",
            venv_name="sglang-router",
            # uvloop is what an SGLang install brings along; uvicorn picks it up by itself.
            packages=("sglang-router", "uvloop"),
            build_argv=_mini_lb_argv,
            help_argv=("python", "-m", "sglang_router.launch_router", "--help"),
            description="sglang-router (PyPI) --mini-lb, random",
        ),
        Peer(
            name="smg",
            venv_name="smg",
            packages=("smg",),
            build_argv=_smg_argv,
            help_argv=("smg", "launch", "--help"),
            description="smg (PyPI, Rust), round_robin",
        ),
    )
}


class PeerSetupError(RuntimeError):
    """A peer's venv could not be created or its command does not run."""


def ensure_venv(
    venv: Path, packages: Sequence[str], python: str = "python3.11", wheels: Path | None = None
) -> Path:
    """Create venv and pip-install packages into it (from PyPI, or only from the folder
    ``wheels``) unless a stamp says that was done."""
    digest = hashlib.sha256(" ".join(packages).encode()).hexdigest()[:12]
    stamp = venv / f".bench-installed-{digest}"
    if stamp.exists():
        return venv
    if not (venv / "bin" / "python").exists():
        _run([python, "-m", "venv", str(venv)], INSTALL_TIMEOUT_S)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    if wheels is not None:
        pip += ["--no-index", "--find-links", str(wheels)]
    _run([*pip, "--upgrade", *packages], INSTALL_TIMEOUT_S)
    stamp.touch()
    return venv


def ensure_py_spy(python: str = "python3.11", wheels: Path | None = None) -> Path:
    """The py-spy executable, installed from PyPI into bench/venvs/tools on first use."""
    return ensure_venv(TOOLS_VENV, (PY_SPY,), python, wheels) / "bin" / PY_SPY


def _run(argv: Sequence[str], timeout: float) -> None:
    """Run a setup step, raising PeerSetupError with its output when it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise PeerSetupError(f"{' '.join(argv)} timed out after {timeout:.0f}s") from exc
    if done.returncode != 0:
        raise PeerSetupError(
            f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def ensure_peer(peer: Peer, python: str = "python3.11", wheels: Path | None = None) -> Path:
    """Create the peer's venv and install its packages unless already done; return the venv."""
    if peer.venv_name is None:
        if not (peer.venv / "bin" / peer.help_argv[0]).exists():
            raise PeerSetupError(f"{peer.name}: {peer.venv} is missing; run `make install` first")
        return peer.venv
    return ensure_venv(peer.venv, peer.packages, python, wheels)


def check_peer(peer: Peer) -> None:
    """Run the peer's --help once so a broken install is found before the benchmark starts."""
    exe, *rest = peer.help_argv
    _run([str(peer.venv / "bin" / exe), *rest], HELP_TIMEOUT_S)


def _select(names: Sequence[str]) -> list[Peer]:
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {unknown}; choose from {sorted(PEERS)}")
    return [PEERS[name] for name in names] if names else list(PEERS.values())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("action", choices=("setup", "check"))
    parser.add_argument(
        "peers", nargs="*", help=f"subset of {sorted(PEERS)}, or {PY_SPY} (default: all peers)"
    )
    parser.add_argument("--python", default=os.environ.get("PYTHON", "python3.11"))
    parser.add_argument("--wheels", type=Path, help="install from this folder of wheels only")
    args = parser.parse_args(argv)
    failed = 0
    if PY_SPY in args.peers:
        args.peers.remove(PY_SPY)
        try:
            print(f"{PY_SPY}: ok ({ensure_py_spy(args.python, args.wheels)})")
        except PeerSetupError as exc:
            failed += 1
            print(f"{PY_SPY}: FAILED: {exc}", file=sys.stderr)
        if not args.peers:
            return failed
    for peer in _select(args.peers):
        try:
            if args.action == "setup":
                ensure_peer(peer, args.python, args.wheels)
            check_peer(peer)
        except PeerSetupError as exc:
            failed += 1
            print(f"{peer.name}: FAILED: {exc}", file=sys.stderr)
            continue
        print(f"{peer.name}: ok ({peer.venv})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
