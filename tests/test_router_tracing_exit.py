"""A router with tracing on stops within its bound however its OTLP collector behaves: one that
accepts connections and never answers, or a port where nothing listens, must not hold up the
exit (the OpenTelemetry SDK alone waits up to 30 s for its last export)."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator

import pytest

pytest.importorskip(
    "opentelemetry.sdk", reason="needs the otel extra: pip install -e '.[otel]' (make install)"
)

from pd_router.otel_tracing import SHUTDOWN_SECS
from tests.router_helpers import generate_body
from tests.router_process import router_process

# The exit's other steps (the data planes, the client sessions) take well under this.
EXIT_MARGIN_SECS = 3.0


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.0)


@pytest.fixture
def silent_collector() -> Iterator[str]:
    """An endpoint whose listener takes connections into its backlog and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def closed_port() -> str:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def stop_secs(cluster, endpoint: str, workers: int) -> tuple[float, str]:
    """How long the router takes to exit after SIGTERM, with spans waiting for ``endpoint``,
    and its log."""
    async with (
        router_process(
            prefill=cluster.prefill_urls,
            decode=cluster.decode_urls,
            tracing={"enabled": True, "endpoint": endpoint},
            server={"workers": workers},
        ) as router,
        router.client() as http,
    ):
        for i in range(5):
            assert (
                await http.post("/generate", json=generate_body(f"traced {i}"))
            ).status_code == 200
        started = time.monotonic()
        router.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(router.process.wait(), SHUTDOWN_SECS + 30)
        return time.monotonic() - started, router.log_text()


@pytest.mark.parametrize("workers", [1, 2], ids=["one process", "two data planes"])
async def test_a_silent_collector_holds_the_exit_no_longer_than_the_bound(
    cluster, silent_collector, workers
):
    took, log = await stop_secs(cluster, silent_collector, workers)
    assert took < SHUTDOWN_SECS + EXIT_MARGIN_SECS, log[-2000:]
    assert "the spans not exported yet are dropped" in log


async def test_a_collector_that_refuses_connections_holds_the_exit_no_longer_than_the_bound(
    cluster, closed_port
):
    took, log = await stop_secs(cluster, closed_port, 1)
    assert took < SHUTDOWN_SECS + EXIT_MARGIN_SECS, log[-2000:]
