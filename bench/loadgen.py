"""Closed-loop load generator: N concurrent clients sending /generate to one router, or spread
over several (``--url`` repeated: client i sends to the i-th url modulo their number). Several
generator processes share one measurement window when started with the same ``--start-at``.

Runs as its own process (aiohttp client on uvloop) so its CPU is never charged to the router
or to the orchestrator. Each client sends a request, waits for the full answer (non-streaming
JSON body, or the SSE stream up to `data: [DONE]`), and sends the next one. Only answers that
complete inside the measurement window (after the warm-up) count toward throughput and
latency; errors are counted over the whole run. The CPU time of the router (its whole process
tree) and of the workers is read from /proc exactly at the window's edges. One JSON object is
written to --output (a file: results hold every latency and can exceed a pipe's buffer).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import httptools
import orjson
import uvloop
from proc_cpu import tree_cpu_seconds

MAX_ERROR_SAMPLES = 5
DRAIN_GRACE_S = 10.0


@dataclass(frozen=True)
class LoadConfig:
    """What to send, how hard and for how long."""

    urls: tuple[str, ...]
    concurrency: int
    warmup_s: float
    duration_s: float
    stream: bool
    max_new_tokens: int
    request_timeout_s: float
    cpu_pids: tuple[int, ...]
    backend_pids: tuple[int, ...]
    start_at: float | None = None
    client: str = "aiohttp"


@dataclass
class Tally:
    """Outcomes collected by all clients of one run."""

    latencies_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_samples) < MAX_ERROR_SAMPLES:
            self.error_samples.append(message)


class BadAnswer(Exception):
    """The router answered, but not with a complete, successful generation."""


def _body(client: int, cfg: LoadConfig) -> bytes:
    """A small distinct prompt per client, so no peer benefits from identical requests."""
    return orjson.dumps(
        {
            "text": f"Client {client} asks: what is the capital of France? Answer briefly.",
            "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": 0},
            "stream": cfg.stream,
        }
    )


async def _exchange(
    session: aiohttp.ClientSession, cfg: LoadConfig, url: str, body: bytes
) -> float | None:
    """Send one request and read the full answer; return the time to first byte if streaming."""
    started = time.perf_counter()
    headers = {"Content-Type": "application/json"}
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise BadAnswer(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        if not cfg.stream:
            answer = orjson.loads(await resp.read())
            if not isinstance(answer, dict) or "text" not in answer:
                raise BadAnswer(f"no text in answer: {str(answer)[:200]}")
            return None
        first: float | None = None
        tail = b""
        async for chunk in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - started
            tail = (tail + chunk)[-64:]
        if b"[DONE]" not in tail:
            raise BadAnswer(f"stream ended without [DONE]: {tail!r}")
        return first


class FastConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the ``fast`` client: the request is sent as
    prepared bytes and the answer parsed by httptools, so a request costs the generator a
    fraction of what aiohttp's client costs (the generator must not be what saturates)."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.answer: asyncio.Future[tuple[float | None, bytes]] | None = None
        self.body = bytearray()
        self.first: float | None = None
        self.open = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail(ConnectionError(f"connection closed: {exc}"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadAnswer(f"unparsable answer: {exc}"))
            self.close()

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        self.body += body
        if self.stream and len(self.body) > 4096:
            del self.body[:-64]

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.answer is not None and not self.answer.done():
            if status != 200:
                self.answer.set_exception(BadAnswer(f"HTTP {status}: {bytes(self.body[:200])!r}"))
            else:
                self.answer.set_result((self.first, bytes(self.body)))
        if not self.parser.should_keep_alive():
            self.close()

    def _fail(self, exc: Exception) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes, timeout_s: float) -> tuple[float | None, bytes]:
        """Send one request; (time of the first body byte, body or its tail)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.answer, self.first = loop.create_future(), None
        self.body.clear()
        self.transport.write(request)
        timer = loop.call_later(timeout_s, self._fail, TimeoutError("no answer in time"))
        try:
            return await self.answer
        finally:
            timer.cancel()


def _request_bytes(url: str, body: bytes) -> tuple[str, int, bytes]:
    """(host, port, the whole POST request) for url."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return host, port, head.encode() + body


async def _fast_exchange(
    connection: FastConnection, cfg: LoadConfig, request: bytes, started: float
) -> float | None:
    """One request on a fast connection, its answer checked as _exchange checks it."""
    first, body = await connection.exchange(request, cfg.request_timeout_s)
    if not cfg.stream:
        answer = orjson.loads(body)
        if not isinstance(answer, dict) or "text" not in answer:
            raise BadAnswer(f"no text in answer: {str(answer)[:200]}")
        return None
    if b"[DONE]" not in body[-64:]:
        raise BadAnswer(f"stream ended without [DONE]: {body[-64:]!r}")
    return None if first is None else first - started


async def _fast_client(cfg: LoadConfig, index: int, window: tuple[float, float], tally: Tally):
    """_client on one FastConnection, reopened after an error or a close."""
    host, port, request = _request_bytes(cfg.urls[index % len(cfg.urls)], _body(index, cfg))
    loop = asyncio.get_running_loop()
    connection: FastConnection | None = None
    while time.perf_counter() < window[1]:
        started = time.perf_counter()
        try:
            if connection is None or not connection.open:
                _, connection = await loop.create_connection(
                    lambda: FastConnection(cfg.stream), host, port
                )
            ttft = await _fast_exchange(connection, cfg, request, started)
        except (OSError, TimeoutError, BadAnswer, orjson.JSONDecodeError) as exc:
            tally.error(f"{type(exc).__name__}: {exc}")
            if connection is not None:
                connection.close()
            continue
        _record(tally, window, started, ttft)
    if connection is not None:
        connection.close()


async def _client(
    session: aiohttp.ClientSession,
    cfg: LoadConfig,
    index: int,
    window: tuple[float, float],
    tally: Tally,
) -> None:
    """Send requests back to back until the window closes, recording those that end in it."""
    url, body = cfg.urls[index % len(cfg.urls)], _body(index, cfg)
    while time.perf_counter() < window[1]:
        started = time.perf_counter()
        try:
            ttft = await _exchange(session, cfg, url, body)
        except (aiohttp.ClientError, TimeoutError, BadAnswer, orjson.JSONDecodeError) as exc:
            tally.error(f"{type(exc).__name__}: {exc}")
            continue
        _record(tally, window, started, ttft)


def _record(tally: Tally, window: tuple[float, float], started: float, ttft: float | None) -> None:
    """Count an answer that ended inside the window."""
    ended = time.perf_counter()
    if window[0] <= ended <= window[1]:
        tally.completed += 1
        tally.latencies_ms.append((ended - started) * 1000.0)
        if ttft is not None:
            tally.ttft_ms.append(ttft * 1000.0)


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_snapshot(cfg: LoadConfig) -> tuple[float, float, float]:
    """(router tree, workers' trees, this process) CPU seconds right now."""
    return (
        sum(tree_cpu_seconds(pid) for pid in cfg.cpu_pids),
        sum(tree_cpu_seconds(pid) for pid in cfg.backend_pids),
        _own_cpu_seconds(),
    )


async def run(cfg: LoadConfig) -> dict[str, object]:
    """Drive the load and return the tally with the CPU used inside the window."""
    tally = Tally()
    connector = aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=cfg.concurrency)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if cfg.start_at is not None:
            await asyncio.sleep(max(0.0, cfg.start_at - time.time()))
        now = time.perf_counter()
        window = (now + cfg.warmup_s, now + cfg.warmup_s + cfg.duration_s)
        clients = [
            asyncio.create_task(
                _fast_client(cfg, i, window, tally)
                if cfg.client == "fast"
                else _client(session, cfg, i, window, tally)
            )
            for i in range(cfg.concurrency)
        ]
        await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
        cpu_start = _cpu_snapshot(cfg)
        measured_from = time.perf_counter()
        await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
        cpu_end = _cpu_snapshot(cfg)
        measured_s = time.perf_counter() - measured_from
        _, pending = await asyncio.wait(clients, timeout=cfg.request_timeout_s + DRAIN_GRACE_S)
        for task in pending:
            task.cancel()
    return {
        "completed": tally.completed,
        "errors": tally.errors,
        "error_samples": tally.error_samples,
        "window_s": measured_s,
        "latencies_ms": tally.latencies_ms,
        "ttft_ms": tally.ttft_ms,
        "router_cpu_s": cpu_end[0] - cpu_start[0],
        "backend_cpu_s": cpu_end[1] - cpu_start[1],
        "loadgen_cpu_s": cpu_end[2] - cpu_start[2],
    }


def parse_args(argv: Sequence[str] | None) -> tuple[Path, LoadConfig]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--url",
        action="append",
        required=True,
        help="e.g. http://127.0.0.1:30000/generate; repeat to spread the clients",
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--cpu-pid", type=int, action="append", default=[], help="a router")
    parser.add_argument("--backend-pid", type=int, action="append", default=[], help="a worker")
    parser.add_argument("--output", type=Path, required=True, help="where to write the JSON")
    parser.add_argument(
        "--client",
        choices=("aiohttp", "fast"),
        default="aiohttp",
        help="fast: keep-alive connections with httptools' parser, far less CPU per request",
    )
    parser.add_argument(
        "--start-at",
        type=float,
        help="wall-clock time (epoch seconds) to start at, so several generators share a window",
    )
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.duration <= 0 or args.warmup < 0:
        parser.error("need --concurrency >= 1, --duration > 0, --warmup >= 0")
    return args.output, LoadConfig(
        urls=tuple(args.url),
        concurrency=args.concurrency,
        warmup_s=args.warmup,
        duration_s=args.duration,
        stream=args.stream,
        max_new_tokens=args.max_new_tokens,
        request_timeout_s=args.request_timeout,
        cpu_pids=tuple(args.cpu_pid),
        backend_pids=tuple(args.backend_pid),
        start_at=args.start_at,
        client=args.client,
    )


def main(argv: Sequence[str] | None = None) -> int:
    output, cfg = parse_args(argv)
    output.write_bytes(orjson.dumps(uvloop.run(run(cfg))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
