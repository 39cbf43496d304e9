"""The capacity counters of the reference worker's /v1/loads ranks, read as SGLang 0.5.23's:
``total_prefill_uncached_tokens`` and ``total_prefill_busy_us`` of every prefill forward, and
``decode_moments`` (``[n, Σb, Σt, Σb², Σb·t, Σg]`` over decode steps of batch size b, time t
in µs, g tokens generated), which the router's autopilot fits to estimate a worker's capacity.

The workers run at speed 1 with slow, steep steps, so the measured times follow the timing
model closely enough for generous margins on a loaded machine.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pd_worker.testing import pd_generate

TIMEOUT = 10.0
PREFILL_OVERHEAD_SECS = 0.02
PREFILL_SECS_PER_TOKEN = 0.0005
STEP_BASE_SECS = 0.01
STEP_PER_REQ_SECS = 0.005
# Prompts with distinct first bytes share no prefix page, so the prefix cache serves none.
PROMPTS = ("alpha prompt", "bravo, a longer prompt", "charlie")


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture
def timed_pair(cluster_factory):
    """1P1D at speed 1 whose forwards and decode steps take modeled time."""
    return cluster_factory(
        prefill=1,
        decode=1,
        speed=1.0,
        prefill_batch_overhead_secs=PREFILL_OVERHEAD_SECS,
        prefill_secs_per_token=PREFILL_SECS_PER_TOKEN,
        decode_step_base_secs=STEP_BASE_SECS,
        decode_step_per_req_secs=STEP_PER_REQ_SECS,
    )


async def load_of(client: httpx.AsyncClient, url: str) -> dict:
    return (await client.get(url + "/v1/loads")).json()["loads"][0]


async def send(client: httpx.AsyncClient, cluster, prompt: str, max_new_tokens: int) -> None:
    """One request through the pair, checked to have succeeded on both sides."""
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens}}
    p, d = await pd_generate(client, prefill, decode, cluster.bootstrap_port(prefill), body)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)


def fitted_slope(moments: list[float]) -> float:
    """Least-squares slope of step time over batch size, from the moment sums."""
    n, sum_b, sum_t, sum_bb, sum_bt, _ = moments
    return (n * sum_bt - sum_b * sum_t) / (n * sum_bb - sum_b * sum_b)


async def test_prefill_counts_the_uncached_prompt_tokens_it_forwarded(timed_pair, client):
    for prompt in PROMPTS:
        await send(client, timed_pair, prompt, 1)
    load = await load_of(client, timed_pair.prefill_urls[0])
    assert load["total_prefill_uncached_tokens"] == sum(len(p.encode()) for p in PROMPTS)


async def test_prefill_busy_time_is_the_modeled_forward_time(timed_pair, client):
    for prompt in PROMPTS:
        await send(client, timed_pair, prompt, 1)
    modeled_us = 1e6 * sum(
        PREFILL_OVERHEAD_SECS + len(p.encode()) * PREFILL_SECS_PER_TOKEN for p in PROMPTS
    )
    busy_us = (await load_of(client, timed_pair.prefill_urls[0]))["total_prefill_busy_us"]
    assert 0.9 * modeled_us <= busy_us <= modeled_us + 100_000


async def test_decode_moments_count_one_generated_token_per_request_step(timed_pair, client):
    await asyncio.gather(*(send(client, timed_pair, p, 5 + i) for i, p in enumerate(PROMPTS)))
    moments = (await load_of(client, timed_pair.decode_urls[0]))["decode_moments"]
    generated = 5 + 6 + 7
    assert moments[5] == pytest.approx(generated)
    assert moments[1] == pytest.approx(generated)


async def test_decode_moments_recover_the_per_request_step_cost(timed_pair, client):
    lengths = (4, 8, 12, 16)
    await asyncio.gather(
        *(send(client, timed_pair, f"{'abcd'[i]} request", n) for i, n in enumerate(lengths))
    )
    moments = (await load_of(client, timed_pair.decode_urls[0]))["decode_moments"]
    slope_us = fitted_slope(moments)
    assert 0.5 * STEP_PER_REQ_SECS * 1e6 <= slope_us <= 1.5 * STEP_PER_REQ_SECS * 1e6


async def test_a_fresh_worker_reports_no_decode_moments(timed_pair, client):
    load = await load_of(client, timed_pair.decode_urls[0])
    assert load["decode_moments"] is None


async def test_counters_outlive_a_role_switch(timed_pair, client):
    await send(client, timed_pair, PROMPTS[0], 3)
    decode = timed_pair.decode_urls[0]
    before = (await load_of(client, decode))["decode_moments"]
    reply = await client.post(decode + "/pd_role_switch", json={"new_role": "prefill"})
    assert reply.status_code == 200, reply.text
    assert (await load_of(client, decode))["decode_moments"] == before
