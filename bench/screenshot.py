"""Render the router's status page of a running demo to a PNG (``make screenshot``).

Starts a 2P2D of reference workers (real-time timing model) and ``pd-router`` in front of them,
keeps requests flowing, converts one prefill to decode and one decode to prefill through the
router, then asks headless Chromium for a screenshot of ``/dashboard`` while traffic is in
flight. Everything is stopped afterwards.

    .venv/bin/python bench/screenshot.py [--output docs/img/dashboard.png] [--size 1280,900]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from pd_worker.cluster import WorkerCluster, free_port

ROOT = Path(__file__).resolve().parent.parent
PD_ROUTER = str(Path(sys.executable).with_name("pd-router"))
READY_TIMEOUT_SECS = 30.0
CHROMIUM_TIMEOUT_SECS = 60.0
CLIENTS = 10
TOKENS_PER_REQUEST = 300  # about 3.5 s per request at speed 1.0
SETTLE_SECS = 5.0  # let the clients spread over the converted workers


@contextlib.contextmanager
def router_process(cluster: WorkerCluster, port: int):
    """``pd-router`` (the console script) in front of ``cluster``, stopped on exit."""
    argv = [PD_ROUTER, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    for url in cluster.prefill_urls:
        argv += ["--prefill", url, str(cluster.bootstrap_port(url))]
    for url in cluster.decode_urls:
        argv += ["--decode", url]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_ready(http: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECS
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get("/readiness")).status_code == 200:
                return
        await asyncio.sleep(0.1)
    raise SystemExit(f"router not ready after {READY_TIMEOUT_SECS}s")


async def client_loop(http: httpx.AsyncClient, index: int, stop: asyncio.Event) -> None:
    body = {
        "text": f"client {index}: tell me about prefill and decode",
        "sampling_params": {"max_new_tokens": TOKENS_PER_REQUEST},
    }
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            await http.post("/generate", json=body)


@contextlib.asynccontextmanager
async def traffic(http: httpx.AsyncClient) -> AsyncIterator[None]:
    """``CLIENTS`` closed-loop clients until the block ends."""
    stop = asyncio.Event()
    clients = [asyncio.create_task(client_loop(http, i, stop)) for i in range(CLIENTS)]
    try:
        yield
    finally:
        stop.set()
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)


async def convert(http: httpx.AsyncClient, url: str, role: str) -> None:
    response = await http.post("/convert_pd_role", json={"server_url": url, "new_role": role})
    record = response.json()
    print(f"convert {url} -> {role}: {record.get('status')} {record.get('message', '')}")


async def screenshot(url: str, output: Path, size: str) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium not found (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="pd-router-chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
            f"--window-size={size}", "--virtual-time-budget=2500",
            f"--screenshot={output}", url,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await asyncio.wait_for(process.wait(), CHROMIUM_TIMEOUT_SECS)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise SystemExit("chromium did not finish the screenshot") from None
    if process.returncode != 0:
        raise SystemExit(f"chromium failed with exit code {process.returncode}")


async def run(output: Path, size: str) -> None:
    with (
        WorkerCluster(prefill=2, decode=2, speed=1.0) as cluster,
        router_process(cluster, free_port()) as router_url,
    ):
        async with httpx.AsyncClient(base_url=router_url, timeout=60.0) as http:
            await wait_ready(http)
            async with traffic(http):
                await convert(http, cluster.prefill_urls[1], "decode")
                await convert(http, cluster.decode_urls[0], "prefill")
                await asyncio.sleep(SETTLE_SECS)
                await screenshot(router_url + "/dashboard", output, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    parser.add_argument("--size", default="1280,900", help="window size WIDTH,HEIGHT")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    asyncio.run(run(args.output, args.size))
    if not args.output.is_file():
        raise SystemExit(f"chromium wrote no {args.output}")
    print(f"wrote {args.output} ({args.output.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
