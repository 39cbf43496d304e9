"""The router's own resources running out are the router's fault, never a worker's.

A router process with a low RLIMIT_NOFILE and a client connection cap set above it has every
descriptor taken by client connections (as the slow-client flood of issue 9 did); a request on
one of them cannot open its legs (EMFILE). The client gets 503 with Retry-After, and the
workers' circuits stay closed and their error counts untouched: they did nothing wrong."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator

import httpx
import orjson

from pd_worker.cluster import WorkerCluster
from tests.router_helpers import generate_body, wait_until

NOFILE = 96  # the router's descriptor limit: room to start, then the fill takes the rest
READ_TIMEOUT = 2.0

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@contextlib.asynccontextmanager
async def router_process(cluster: WorkerCluster, port: int) -> AsyncIterator[str]:
    """``pd-router`` in its own process with RLIMIT_NOFILE = NOFILE, over ``cluster``; one
    failure opens a circuit, and no health probe runs during the test."""
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    argv = [
        sys.executable, "-m", "pd_router.cli.main", "--host", "127.0.0.1", "--port", str(port),
        "--prefill", prefill, str(cluster.bootstrap_port(prefill)), "--decode", decode,
        "--health-check-interval-secs", "60", "--cb-failure-threshold", "1",
        "--log-level", "warning", "--log-format", "text",
        # Above the descriptors it has (allowed, with a warning), so clients can take them all.
        "--max-client-connections", str(NOFILE * 10),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE)),
        )
        try:
            await wait_until(lambda: _ready(url, process), 20.0, "router ready")
            yield url
        finally:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10.0)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _ready(url: str, process: asyncio.subprocess.Process) -> bool:
    if process.returncode is not None:
        raise AssertionError(f"router exited with {process.returncode}")
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient(timeout=1.0) as http:
            return (await http.get(url + "/readiness")).status_code == 200
    return False


async def exchange(conn: Connection, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one HTTP/1.1 request on an open connection; (status, headers, body) of the answer."""
    reader, writer = conn
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT)
    return int(lines[0].split()[1]), headers, body


HEALTH = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"


async def take_every_descriptor(port: int) -> list[Connection]:
    """Open connections to the router until it serves no more; the ones it serves."""
    served: list[Connection] = []
    for _ in range(NOFILE):
        conn = await asyncio.open_connection("127.0.0.1", port)
        try:
            await exchange(conn, HEALTH)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            conn[1].close()
            return served
        served.append(conn)
    raise AssertionError(f"the router served {NOFILE} connections with a limit of {NOFILE}")


def generate_request(prompt: str) -> bytes:
    body = orjson.dumps(generate_body(prompt, 4))
    return (
        b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


async def _serves(http: httpx.AsyncClient) -> bool:
    with contextlib.suppress(httpx.TransportError):
        response = await http.post("/generate", json=generate_body("fds back", 4))
        return response.status_code == 200
    return False


def samples(metrics: str, name: str) -> dict[str, float]:
    """``name``'s samples in a Prometheus exposition, by their label text."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            out[labels] = float(value)
    return out


async def test_router_out_of_descriptors_answers_503_and_blames_no_worker(
    cluster_factory, free_port
):
    cluster = cluster_factory(prefill=1, decode=1, speed=0.0)
    port = free_port()
    async with router_process(cluster, port) as url:
        served = await take_every_descriptor(port)
        assert served, "the router served no connection at all"
        try:
            status, headers, body = await exchange(served[0], generate_request("no fd left"))
        finally:
            for _, writer in served:
                writer.close()
        assert status == 503
        assert headers["retry-after"]
        error = orjson.loads(body)["error"]
        assert (error["code"], error["type"]) == (503, "router_overloaded")
        assert "EMFILE" in error["message"]

        async with httpx.AsyncClient(base_url=url, timeout=10.0) as http:
            # The closed connections give the router its descriptors back (until it noticed,
            # a new connection is closed at once).
            await wait_until(lambda: _serves(http), 10.0, "router serving again")
            metrics = (await http.get("/metrics")).text
        circuits = samples(metrics, "pd_router_circuit_state")
        assert len(circuits) == 2
        assert set(circuits.values()) == {0.0}  # closed
        assert samples(metrics, "pd_router_upstream_errors_total") == {}
