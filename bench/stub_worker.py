"""A stub PD worker that answers at once, to measure router capacity apart from the backend.

`pd_worker` does real PD work per request (bootstrap TCP connection, KV bytes, token loop), so
on 2 shared cores it, not the router, caps the req/s of `bench/overhead.py`. This stub (a bare
asyncio protocol with httptools' parser, so a request costs it little CPU) answers
`/generate` immediately (no bootstrap rendezvous, no KV), with the shapes the routers expect:
a JSON body with `text`, or for `stream` one SSE event per new token and `data: [DONE]`. It also
answers the info and load endpoints the routers probe at start-up (smg asks for `/v1/models`,
`/version`, `/server_info`, `/v1/loads`, `/metrics`). Only for benchmarks: it is not the
protocol reference (that is `pd_worker`).

    python bench/stub_worker.py --role decode --port 31000
    python bench/stub_worker.py --role decode --port 31000 --reuse-port   # one of several

With `--reuse-port` several processes serve one port (SO_REUSEPORT: the kernel spreads the
connections), so one worker URL can use more than one core (bench/scale.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httptools
import httpx
import orjson
import uvloop
from proc_cpu import pinned

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
MAX_STREAM_TOKENS = 4096
JSON = b"application/json"


def _new_tokens(body: dict) -> int:
    params = body.get("sampling_params")
    wanted = params.get("max_new_tokens", 16) if isinstance(params, dict) else 16
    return max(1, min(MAX_STREAM_TOKENS, int(wanted))) if isinstance(wanted, int) else 16


def fixed_answers(role: str) -> dict[bytes, tuple[bytes, bytes]]:
    """path -> (content type, body) of every endpoint but /generate."""
    server_info = {
        "disaggregation_mode": role,
        "model_path": "stub",
        "version": "stub",
        "internal_states": [{"disaggregation_mode": role}],
    }
    model_info = {"model_path": "stub", "tokenizer_path": "stub", "is_generation": True}
    models = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
    answers = {b"/server_info": server_info, b"/get_server_info": server_info}
    answers |= {b"/model_info": model_info, b"/get_model_info": model_info, b"/v1/models": models}
    for path in ("/health", "/health_generate", "/version", "/loads", "/v1/loads", "/get_load"):
        answers[path.encode()] = {}
    for path in ("/flush_cache", "/abort_request"):
        answers[path.encode()] = {}
    table = {path: (JSON, orjson.dumps(payload)) for path, payload in answers.items()}
    table[b"/metrics"] = (b"text/plain; version=0.0.4", b"")
    return table


def _head(status: bytes, content_type: bytes, length: int | None, keep_alive: bool) -> bytes:
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    connection = b"keep-alive" if keep_alive else b"close"
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type + b"\r\n" + framing
        + b"\r\nConnection: " + connection + b"\r\n\r\n"
    )  # fmt: skip


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StubProtocol(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive requests parsed by httptools, each answered
    at once from on_message_complete (no task per request). Prefill: one short answer.
    Decode: `text`, or one SSE event per token (one chunk, one write each) when streaming."""

    def __init__(self, role: str, answers: dict[bytes, tuple[bytes, bytes]]) -> None:
        self.role, self.answers = role, answers
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body = b"", bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(b"400 Bad Request", JSON, b"{}", keep_alive=False)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path, body = self.url.split(b"?", 1)[0], bytes(self.body)
        self.url, self.body = b"", bytearray()
        keep_alive = self.parser.should_keep_alive()
        if path == b"/generate" and self.parser.get_method() == b"POST":
            self._generate(orjson.loads(body), keep_alive)
        elif path in self.answers:
            self._send(b"200 OK", *self.answers[path], keep_alive=keep_alive)
        else:
            self._send(b"404 Not Found", JSON, b"{}", keep_alive=keep_alive)

    def _generate(self, request: dict, keep_alive: bool) -> None:
        tokens = 1 if self.role == "prefill" else _new_tokens(request)
        if not request.get("stream"):
            answer = {"text": "x" * tokens, "meta_info": {"completion_tokens": tokens}}
            self._send(b"200 OK", JSON, orjson.dumps(answer), keep_alive=keep_alive)
            return
        assert self.transport is not None
        self.transport.write(_head(b"200 OK", b"text/event-stream", None, keep_alive))
        for i in range(1, tokens + 1):
            event = {"text": "x" * i, "meta_info": {"completion_tokens": i}}
            self.transport.write(_chunk(b"data: " + orjson.dumps(event) + b"\n\n"))
        self.transport.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        if not keep_alive:
            self.transport.close()

    def _send(self, status: bytes, content_type: bytes, body: bytes, *, keep_alive: bool) -> None:
        assert self.transport is not None
        self.transport.write(_head(status, content_type, len(body), keep_alive) + body)
        if not keep_alive:
            self.transport.close()


async def serve(role: str, port: int, reuse_port: bool) -> None:
    """Serve until killed."""
    answers = fixed_answers(role)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: StubProtocol(role, answers), "127.0.0.1", port, reuse_port=reuse_port or None
    )
    async with server:
        await server.serve_forever()


@dataclass(frozen=True)
class StubCluster:
    """Where the stubs listen, in the shape of pd_worker's WorkerCluster the bench reads."""

    prefill_urls: list[str]
    decode_urls: list[str]
    bootstrap_ports: dict[str, int]
    pids: list[int]

    def bootstrap_port(self, url: str) -> int:
        return self.bootstrap_ports[url]


def _wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"stub worker {url} exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url + "/health").status_code == 200:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"stub worker {url} not healthy after {STARTUP_TIMEOUT_S:.0f}s")


@contextlib.contextmanager
def stub_cluster(
    prefill: int,
    decode: int,
    ports: Iterator[int],
    *,
    processes_per_worker: int = 1,
    cpus: Iterable[int] | None = None,
) -> Iterator[StubCluster]:
    """Start prefill + decode stub workers on the given free ports, each served by
    ``processes_per_worker`` processes sharing its port, all on ``cpus`` (None: anywhere);
    stop them on exit."""
    processes: list[subprocess.Popen] = []
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    bootstrap: dict[str, int] = {}
    try:
        for role in ("prefill",) * prefill + ("decode",) * decode:
            port = next(ports)
            argv = [sys.executable, str(Path(__file__)), "--role", role, "--port", str(port)]
            if processes_per_worker > 1:
                argv.append("--reuse-port")
            for _ in range(processes_per_worker):
                processes.append(
                    subprocess.Popen(
                        pinned(argv, cpus), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                    )
                )
            url = f"http://127.0.0.1:{port}"
            urls[role].append(url)
            bootstrap[url] = next(ports)
            for process in processes[-processes_per_worker:]:
                _wait_healthy(url, process)
        yield StubCluster(urls["prefill"], urls["decode"], bootstrap, [p.pid for p in processes])
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_TIMEOUT_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=("prefill", "decode"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reuse-port", action="store_true", help="share the port (SO_REUSEPORT)")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.role, args.port, args.reuse_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
