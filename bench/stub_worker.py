"""A stub PD worker that answers at once, to measure router capacity apart from the backend.

`pd_worker` does real PD work per request (bootstrap TCP connection, KV bytes, token loop), so
on 2 shared cores it, not the router, caps the req/s of `bench/overhead.py`. This stub answers
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
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import uvloop
from aiohttp import web
from proc_cpu import pinned

STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
JSON = "application/json"
ROLE = web.AppKey("role", str)
MAX_STREAM_TOKENS = 4096


def _json(payload: object) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type=JSON)


def _new_tokens(body: dict) -> int:
    params = body.get("sampling_params")
    wanted = params.get("max_new_tokens", 16) if isinstance(params, dict) else 16
    return max(1, min(MAX_STREAM_TOKENS, int(wanted))) if isinstance(wanted, int) else 16


async def generate(request: web.Request) -> web.StreamResponse:
    """Prefill: one short answer. Decode: `text`, or one SSE event per token when streaming."""
    body = orjson.loads(await request.read())
    tokens = 1 if request.app[ROLE] == "prefill" else _new_tokens(body)
    if not body.get("stream"):
        return _json({"text": "x" * tokens, "meta_info": {"completion_tokens": tokens}})
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(1, tokens + 1):
        event = {"text": "x" * i, "meta_info": {"completion_tokens": i}}
        await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def server_info(request: web.Request) -> web.Response:
    role = request.app[ROLE]
    return _json(
        {
            "disaggregation_mode": role,
            "model_path": "stub",
            "version": "stub",
            "internal_states": [{"disaggregation_mode": role}],
        }
    )


async def empty(request: web.Request) -> web.Response:
    return _json({})


async def models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [{"id": "stub", "object": "model"}]})


async def model_info(request: web.Request) -> web.Response:
    return _json({"model_path": "stub", "tokenizer_path": "stub", "is_generation": True})


def build_app(role: str) -> web.Application:
    app = web.Application()
    app[ROLE] = role
    app.router.add_post("/generate", generate)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/version", "/loads", "/v1/loads", "/get_load"):
        app.router.add_get(path, empty)
    app.router.add_get("/metrics", lambda _: web.Response(text=""))
    for path in ("/flush_cache", "/abort_request"):
        app.router.add_post(path, empty)
    return app


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
    web.run_app(
        build_app(args.role),
        host="127.0.0.1",
        port=args.port,
        reuse_port=args.reuse_port or None,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
