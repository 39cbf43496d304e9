"""KV bytes per second: mooncake's TransferEngine over TCP vs the plain-TCP fallback, on loopback.

Two processes per transport, as in a 1P1D: a peer process (this script with ``--serve KIND``)
registers a patterned buffer and serves it; this process pulls ``size`` bytes of it into its own
registered buffer through :mod:`pd_worker.kv_transfer`, ``--pulls`` times back to back, and
checks the bytes of the last pull. Both transports are measured in the same run, size by size,
their order alternating each round (a shared machine drifts), over the same buffer sizes and the
same range split: one contiguous range, or ranges of ``--range-kb`` KB (a prompt's slots in
separate runs). Reported per cell: the median, lowest and highest GB/s over rounds, and the CPU
seconds per GB of this process (the puller) and of the peer (the server).

    .venv/bin/python bench/kv_transfer.py
    .venv/bin/python bench/kv_transfer.py --sizes-mb 1,16,64 --range-kb 0,64 --rounds 5 --pulls 8

Results go to stdout and bench/results/kv_transfer-<timestamp>.md. Exit status 1 if a pull
failed or delivered wrong bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import orjson
from proc_cpu import tree_cpu_seconds

from pd_worker.kv_transfer import TRANSPORTS, KVTransport, TransportUnavailable, make_transport

HOST = "127.0.0.1"
BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
MB = 1 << 20
GB = 1e9


@dataclass
class Peer:
    process: subprocess.Popen[str]
    endpoint: str
    ptr: int


@dataclass
class Cell:
    """One (size, range split, transport): a GB/s figure per round and the CPU it cost."""

    rates: list[float] = field(default_factory=list)
    bytes: int = 0
    puller_cpu: float = 0.0
    peer_cpu: float = 0.0


def pattern(nbytes: int) -> bytes:
    period = bytes(range(251))
    return (period * (nbytes // len(period) + 1))[:nbytes]


async def serve(kind: str, nbytes: int) -> None:
    """Peer mode: register a patterned buffer, announce it on stdout, serve until stdin closes."""
    buffer = ctypes.create_string_buffer(pattern(nbytes), nbytes)
    transport = make_transport(kind, HOST)
    transport.register(ctypes.addressof(buffer), nbytes)
    announce = {"endpoint": transport.endpoint, "ptr": ctypes.addressof(buffer)}
    sys.stdout.write(orjson.dumps(announce).decode() + "\n")
    sys.stdout.flush()
    await asyncio.to_thread(sys.stdin.read)
    transport.close()


def start_peer(kind: str, nbytes: int) -> Peer:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--buffer-bytes", str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = process.stdout.readline() if process.stdout else ""
    if not line:
        raise SystemExit(f"{kind} peer exited before serving (status {process.wait(10)})")
    announced = orjson.loads(line)
    return Peer(process, announced["endpoint"], announced["ptr"])


def split(size: int, range_kb: int) -> list[tuple[int, int, int]]:
    """``size`` bytes as one range (``range_kb`` 0) or as consecutive ranges of that many KB."""
    step = range_kb * 1024 if range_kb else size
    return [(offset, offset, min(step, size - offset)) for offset in range(0, size, step)]


async def measure(
    transport: KVTransport,
    peer: Peer,
    local_ptr: int,
    ranges: list[tuple[int, int, int]],
    pulls: int,
) -> tuple[float, float, float]:
    """Seconds for ``pulls`` back-to-back pulls, and the CPU seconds of puller and peer."""
    puller_before, peer_before = tree_cpu_seconds(os.getpid()), tree_cpu_seconds(peer.process.pid)
    started = time.perf_counter()
    for _ in range(pulls):
        await transport.pull(peer.endpoint, peer.ptr, local_ptr, ranges)
    elapsed = time.perf_counter() - started
    puller = tree_cpu_seconds(os.getpid()) - puller_before
    return elapsed, puller, tree_cpu_seconds(peer.process.pid) - peer_before


def check(destination: ctypes.Array[ctypes.c_char], size: int, expected: bytes) -> None:
    if ctypes.string_at(ctypes.addressof(destination), size) != expected[:size]:
        raise SystemExit(f"wrong bytes after a pull of {size} bytes")


async def run(args: argparse.Namespace) -> dict[tuple[int, int, str], Cell]:
    sizes = [mb * MB for mb in args.sizes_mb]
    largest = max(sizes)
    expected = pattern(largest)
    peers = {kind: start_peer(kind, largest) for kind in TRANSPORTS}
    transports = {kind: make_transport(kind, HOST) for kind in TRANSPORTS}
    destination = ctypes.create_string_buffer(largest)
    local_ptr = ctypes.addressof(destination)
    cells: dict[tuple[int, int, str], Cell] = {}
    try:
        for kind, transport in transports.items():
            transport.register(local_ptr, largest)
            await transport.pull(peers[kind].endpoint, peers[kind].ptr, local_ptr, split(MB, 0))
        for round_index in range(args.rounds):
            order = TRANSPORTS if round_index % 2 == 0 else TRANSPORTS[::-1]
            for size in sizes:
                for range_kb in args.range_kb:
                    ranges = split(size, range_kb)
                    for kind in order:
                        ctypes.memset(local_ptr, 0, size)
                        elapsed, puller, peer = await measure(
                            transports[kind], peers[kind], local_ptr, ranges, args.pulls
                        )
                        check(destination, size, expected)
                        cell = cells.setdefault((size, range_kb, kind), Cell())
                        cell.rates.append(size * args.pulls / elapsed / GB)
                        cell.bytes += size * args.pulls
                        cell.puller_cpu += puller
                        cell.peer_cpu += peer
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for transport in transports.values():
            transport.close()
        for peer in peers.values():
            peer.process.kill()
            peer.process.wait(10)
    return cells


def report(args: argparse.Namespace, cells: dict[tuple[int, int, str], Cell]) -> str:
    lines = [
        f"sizes {args.sizes_mb} MB, range split {args.range_kb} KB (0 = one range), "
        f"{args.rounds} rounds x {args.pulls} pulls, {os.cpu_count()} cores, loopback",
        "",
        "| size | ranges | transport | GB/s median | GB/s min-max | puller CPU s/GB "
        "| peer CPU s/GB |",
        "|---|---|---|---|---|---|---|",
    ]
    for (size, range_kb, kind), cell in cells.items():
        gigabytes = cell.bytes / GB
        split_text = "1" if not range_kb else f"{size // (range_kb * 1024)} x {range_kb} KB"
        lines.append(
            f"| {size // MB} MB | {split_text} | {kind} | {statistics.median(cell.rates):.2f} "
            f"| {min(cell.rates):.2f}-{max(cell.rates):.2f} | {cell.puller_cpu / gigabytes:.2f} "
            f"| {cell.peer_cpu / gigabytes:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=_ints, default=[1, 16, 64])
    parser.add_argument("--range-kb", type=_ints, default=[0, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pulls", type=int, default=8)
    parser.add_argument("--serve", choices=TRANSPORTS, help=argparse.SUPPRESS)
    parser.add_argument("--buffer-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def main() -> None:
    args = parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.buffer_bytes))
        return
    try:
        cells = asyncio.run(run(args))
    except TransportUnavailable as exc:
        raise SystemExit(f"cannot measure: {exc}") from exc
    text = report(args, cells)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (RESULTS / f"kv_transfer-{stamp}.md").write_text(text)


if __name__ == "__main__":
    main()
