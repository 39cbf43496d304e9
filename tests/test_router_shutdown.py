"""SIGTERM and SIGINT: the router says it stops, stops accepting, and lets the requests in flight
finish within its shutdown grace (``--shutdown-grace-period-secs``), then stops anyway, in one
process and with ``--workers 2``."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.conversion_helpers import wait_for_busy
from tests.router_process import router_process

# More than a minute of decoding at the cluster's speed: it outlasts the default grace (60 s).
ENDLESS = {"text": "a very long generation", "sampling_params": {"max_new_tokens": 100_000}}
# Far under the default grace, far over the 0.5 s given (a loaded machine stops slowly).
STOPPED_WITHIN_SECS = 15.0


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1, speed=0.05)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_is_logged_and_the_grace_bounds_the_wait_for_requests(
    cluster, workers, signum
):
    async with (
        router_process(
            prefill=cluster.prefill_urls,
            decode=cluster.decode_urls,
            server={"workers": workers, "shutdown_grace_secs": 0.5},
        ) as router,
        router.client() as http,
    ):
        long = asyncio.create_task(http.post("/generate", json=ENDLESS))
        await wait_for_busy(cluster.decode_urls)
        assert not long.done()
        started = time.monotonic()
        router.process.send_signal(signum)
        await asyncio.wait_for(router.process.wait(), 2 * STOPPED_WITHIN_SECS)
        stopped_in = time.monotonic() - started
        with pytest.raises(httpx.HTTPError):
            await long
        log = router.log_text()
    assert stopped_in < STOPPED_WITHIN_SECS
    assert f"{signum.name} received: stopping; requests in flight" in log
    assert "have 0.5s to finish" in log
