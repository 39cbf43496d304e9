"""A conversion ended from outside while its switch call may be out (the router told to stop
with SIGTERM, an operator's abort, a killed control process): what the router records and logs
the worker became is what the worker really is, in one process and with ``--workers 2``.

A conversion still draining when the signal comes is aborted at once: the worker stays in its
pool with its admission open, even if the shutdown itself lets the drain end. One whose switch
call went out cannot be taken back (the worker switches once its own drain ends, whoever asked):
the router waits for the answer within its shutdown grace and logs the outcome, or, when the
grace ends first, says that the role is unknown, never that the worker is back in its pool; an
operator's abort is refused (409) and the conversion goes on to its real end."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from pd_worker.testing import pd_generate
from tests.conversion_helpers import LONG, live_roles, wait_for_busy, worker_role
from tests.router_helpers import wait_until
from tests.router_process import RouterProcess, router_process

SPEED = 0.05
PROCESSES = [1, 2]


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=2, speed=SPEED)


async def started_conversion(router: RouterProcess, url: str, status: str) -> str:
    """Start converting ``url`` to prefill without waiting; returns its id once the record
    reads ``status``."""
    async with router.client() as http:
        reply = await http.post("/convert_pd_role", json={"server_url": url, "wait": False})
        assert reply.status_code == 202, reply.text
        conversion = reply.json()["id"]

        async def reached() -> bool:
            return (await http.get(f"/conversions/{conversion}")).json()["status"] == status

        await wait_until(reached, 10.0, f"conversion {status}")
    return conversion


async def stopped(router: RouterProcess) -> str:
    """SIGTERM the router, wait for it to exit; its whole log."""
    router.process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(router.process.wait(), 30.0)
    return router.log_text()


def outcome_line(log: str, conversion: str) -> str:
    """The log line that ends ``conversion`` (its status, why, and where the worker went)."""
    lines = [line for line in log.splitlines() if f"conversion {conversion}: " in line]
    return "\n".join(lines)


async def foreign_traffic(cluster, prefill: str, decode: str) -> asyncio.Task:
    """A long request on ``decode`` that no router sent (another router's): the worker's own
    drain waits for it after the switch call, the router's does not."""
    client = httpx.AsyncClient(timeout=60.0)
    task = asyncio.create_task(
        pd_generate(client, prefill, decode, cluster.bootstrap_port(prefill), FOREIGN)
    )
    task.add_done_callback(lambda _: asyncio.ensure_future(client.aclose()))
    await wait_for_busy([decode])
    return task


# About two seconds of decoding at SPEED: the worker's own drain outlasts the router's.
FOREIGN = {"text": "from another router", "sampling_params": {"max_new_tokens": 2400}}


async def sigterm_with_the_switch_call_out(cluster, **server: object) -> tuple[str, str]:
    """Convert a decode busy with foreign traffic to prefill, SIGTERM the router once the switch
    call went out, and let the foreign request end; returns (that decode's role now, the log
    lines of the conversion)."""
    (prefill,), (decode, _) = await live_roles(cluster)
    async with router_process(
        prefill=[prefill], decode=cluster.decode_urls, server=server
    ) as router:
        foreign = await foreign_traffic(cluster, prefill, decode)
        conversion = await started_conversion(router, decode, "switching")
        log = await stopped(router)
    await foreign
    return (await worker_role(decode))["role"], outcome_line(log, conversion)


@pytest.mark.parametrize("workers", PROCESSES)
async def test_sigterm_after_the_switch_call_waits_and_logs_the_role_the_worker_took(
    cluster, workers
):
    role, ended = await sigterm_with_the_switch_call_out(cluster, workers=workers)
    assert role == "prefill"
    assert "succeeded" in ended and "now a prefill" in ended, ended
    assert "back in the decode pool" not in ended, ended


@pytest.mark.parametrize("workers", PROCESSES)
async def test_sigterm_past_the_grace_says_the_role_is_unknown_never_back_in_the_pool(
    cluster, workers
):
    role, ended = await sigterm_with_the_switch_call_out(
        cluster, workers=workers, shutdown_grace_secs=0.2
    )
    assert role == "prefill"
    assert "role is unknown" in ended, ended
    assert "back in the decode pool" not in ended, ended


@pytest.mark.parametrize("workers", PROCESSES)
async def test_sigterm_while_draining_aborts_and_the_worker_stays_a_decode(cluster, workers):
    prefill_urls, decode_urls = await live_roles(cluster)
    async with (
        router_process(
            prefill=prefill_urls, decode=decode_urls, server={"workers": workers}
        ) as router,
        router.client() as http,
    ):
        stream = asyncio.create_task(http.post("/generate", json=LONG))
        decode = await wait_for_busy(decode_urls)
        conversion = await started_conversion(router, decode, "draining")
        log = await stopped(router)
        assert (await stream).status_code == 200
    assert "SIGTERM received: stopping" in log
    ended = outcome_line(log, conversion)
    assert "aborted because the router is shutting down" in ended, log
    assert "back in the decode pool" in ended, log
    reading = await worker_role(decode)
    assert reading["role"] == "decode" and reading["draining"] is False


async def test_a_control_process_killed_with_the_switch_call_out_leaves_the_next_router_the_truth(
    cluster,
):
    """Nothing of a killed control process's record survives; the worker switches anyway, and the
    next router over the same workers routes to it in the role it took."""
    (prefill,), (decode, _) = await live_roles(cluster)
    async with router_process(
        prefill=[prefill], decode=cluster.decode_urls, server={"workers": 2}
    ) as router:
        foreign = await foreign_traffic(cluster, prefill, decode)
        await started_conversion(router, decode, "switching")

        async def call_arrived() -> bool:
            return (await worker_role(decode))["draining"] is True

        # The record reads "switching" as the call goes out: the kill waits until the worker
        # has it (its own drain started), else the call may die with the process unsent.
        await wait_until(call_arrived, 10.0, "the worker has the switch call")
        router.process.send_signal(signal.SIGKILL)
        await router.process.wait()
    await foreign

    async def switched() -> bool:
        return (await worker_role(decode))["role"] == "prefill"

    # The worker's own drain ended with the foreign request; its switch follows a moment later.
    await wait_until(switched, 10.0, "the worker switched with its caller gone")
    async with (
        router_process(
            prefill=[prefill], decode=cluster.decode_urls, server={"workers": 2}
        ) as after,
        after.client() as http,
    ):

        async def listed_as_prefill() -> bool:
            workers = (await http.get("/workers")).json()["workers"]
            return any(w["url"] == decode and w["role"] == "prefill" for w in workers)

        await wait_until(listed_as_prefill, 10.0, "the next router lists the new prefill")


@pytest.mark.parametrize("workers", PROCESSES)
async def test_an_abort_after_the_switch_call_is_refused_and_the_record_follows_the_worker(
    cluster, workers
):
    (prefill,), (decode, _) = await live_roles(cluster)
    async with (
        router_process(
            prefill=[prefill], decode=cluster.decode_urls, server={"workers": workers}
        ) as router,
        router.client() as http,
    ):
        foreign = await foreign_traffic(cluster, prefill, decode)
        conversion = await started_conversion(router, decode, "switching")
        refused = await http.delete(f"/conversions/{conversion}")
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["reason"] == "not_abortable"
        await foreign

        async def ended() -> bool:
            return (await http.get(f"/conversions/{conversion}")).json()["status"] not in (
                "switching",
                "verifying",
            )

        await wait_until(ended, 10.0, "conversion ended")
        record = (await http.get(f"/conversions/{conversion}")).json()
    assert record["status"] == "succeeded", record
    assert (await worker_role(decode))["role"] == "prefill"
