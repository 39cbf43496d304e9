"""Workers started by hand on one host, as README shows: pd-worker's default HTTP port is not
the router's, and workers launched without a bootstrap port do not collide on SGLang's 8998 (a
prefill takes it unless another process holds it; a decode takes a free port). Real worker
processes and a real router on loopback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx

from pd_router.config import RouterConfig
from pd_worker.cli import _build_parser
from pd_worker.cluster import free_port
from tests.router_helpers import assert_paired, generate_body, running_router, wait_until

TOKENS = 3


def test_worker_default_port_is_not_the_routers():
    worker_port = _build_parser().parse_args(["serve"]).port
    assert worker_port != RouterConfig().port


@contextlib.contextmanager
def workers_by_hand(roles: list[str]) -> Iterator[list[str]]:
    """``pd-worker serve --role R --port P`` per role, no bootstrap port; yields their urls."""
    urls, processes = [], []
    try:
        for role in roles:
            port = free_port()
            argv = [
                sys.executable, "-m", "pd_worker", "serve", "--role", role, "--port", str(port),
                "--enable-pd-role-switch", "--speed", "0", "--parent-pid", str(os.getpid()),
            ]  # fmt: skip
            processes.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


async def serving(url: str) -> bool:
    async with httpx.AsyncClient(timeout=2.0) as http:
        try:
            return (await http.get(url + "/health")).status_code == 200
        except httpx.HTTPError:
            return False


async def test_two_prefills_and_two_decodes_started_without_bootstrap_ports_all_serve():
    with workers_by_hand(["prefill", "prefill", "decode", "decode"]) as urls:
        for url in urls:
            await wait_until(lambda url=url: serving(url), 20.0, f"{url} serves")
        async with httpx.AsyncClient(timeout=5.0) as http:
            infos = [(await http.get(url + "/server_info")).json() for url in urls]
        ports = [info["disaggregation_bootstrap_port"] for info in infos]
        assert len(set(ports)) == 4, ports
        prefills, decodes = urls[:2], urls[2:]
        async with (
            running_router(prefill=prefills, decode=decodes, prefill_policy="round_robin") as r,
            r.client() as client,
        ):
            sources = set()
            for n in range(4):
                reply = await client.post("/generate", json=generate_body(f"by hand {n}", TOKENS))
                assert reply.status_code == 200, reply.text
                sources.add(assert_paired(reply.json(), f"by hand {n}", TOKENS))
        assert sources == set(prefills)
