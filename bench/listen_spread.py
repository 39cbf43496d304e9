"""How evenly N processes share one port's keep-alive connections: one listening socket they
all inherit (each accepts from the one queue) or one SO_REUSEPORT socket per process (the
kernel hashes each new connection onto one of them).

Each of the N server processes answers every line it reads with its own index after
``--work-ms`` of CPU (a busy router); the client opens ``--connections`` keep-alive connections
in waves of ``--wave`` while earlier ones keep sending, and reports per round how many
connections each process got (max/min share, and the coefficient of variation over the
processes), summed over ``--rounds`` rounds.

    .venv/bin/python bench/listen_spread.py --processes 4 --connections 64 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import statistics
import time

HOST = "127.0.0.1"


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


async def serve(sock: socket.socket, index: int, work_ms: float) -> None:
    reply = f"{index}\n".encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readline():
            busy(work_ms)
            writer.write(reply)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        await server.serve_forever()


def server_process(sock: socket.socket, index: int, work_ms: float) -> None:
    asyncio.run(serve(sock, index, work_ms))


def reuseport_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen(1024)
    return sock


def start_servers(mode: str, processes: int, work_ms: float) -> tuple[int, list]:
    ctx = multiprocessing.get_context("fork")
    first = reuseport_socket(0) if mode == "reuseport" else socket.create_server((HOST, 0))
    port = first.getsockname()[1]
    sockets = [first] + [
        reuseport_socket(port) if mode == "reuseport" else first for _ in range(processes - 1)
    ]
    procs = [
        ctx.Process(target=server_process, args=(sock, i, work_ms), daemon=True)
        for i, sock in enumerate(sockets)
    ]
    for proc in procs:
        proc.start()
    for sock in set(sockets):
        sock.close()
    return port, procs


async def client_round(port: int, connections: int, wave: int, processes: int) -> list[int]:
    """Open ``connections`` keep-alive connections in waves; every open one keeps asking
    while the next wave connects. Returns connections per process."""
    counts = [0] * processes
    stop = asyncio.Event()
    open_ones: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def keep_asking(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not stop.is_set():
            writer.write(b"x\n")
            await reader.readline()

    tasks = []
    for start in range(0, connections, wave):
        for _ in range(min(wave, connections - start)):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(b"x\n")
            counts[int(await reader.readline())] += 1
            open_ones.append((reader, writer))
            tasks.append(asyncio.create_task(keep_asking(reader, writer)))
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*tasks)
    for _, writer in open_ones:
        writer.close()
    return counts


def measure(mode: str, args: argparse.Namespace) -> list[list[int]]:
    port, procs = start_servers(mode, args.processes, args.work_ms)
    time.sleep(0.3)
    try:
        return [
            asyncio.run(client_round(port, args.connections, args.wave, args.processes))
            for _ in range(args.rounds)
        ]
    finally:
        for proc in procs:
            proc.kill()
            proc.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--wave", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work-ms", type=float, default=0.2)
    args = parser.parse_args()
    print(f"{args.processes} processes, {args.connections} keep-alive connections per round, "
          f"waves of {args.wave}, {args.rounds} rounds, {os.cpu_count()} cores")  # fmt: skip
    print("| listening | per process (sum over rounds) | max/min | worst round max/min | CV |")
    print("|---|---|---:|---:|---:|")
    for mode in ("inherited", "reuseport"):
        rounds = measure(mode, args)
        totals = [sum(column) for column in zip(*rounds, strict=True)]
        worst = max(max(r) / max(1, min(r)) for r in rounds)
        cv = statistics.pstdev(totals) / statistics.mean(totals)
        print(f"| {mode} | {totals} | {max(totals) / max(1, min(totals)):.2f} | "
              f"{worst:.2f} | {cv:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
