"""The reference worker's prefix cache: which prefix a prompt reuses (pure, on token lists),
and through real workers: ``cached_tokens`` in meta_info, a cached prefix that is not
prefilled again, ``/v1/loads`` ``cache_hit_rate`` and ``/flush_cache``."""

from __future__ import annotations

import time

import httpx
import pytest

from pd_worker.prefix_cache import PrefixCache
from pd_worker.testing import pd_generate

PAGE = 4
TIMEOUT = 20.0
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 24


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_an_unseen_prompt_has_nothing_cached():
    cache = PrefixCache(capacity_tokens=1000, page_size=PAGE)
    cache.insert(ids(12))
    assert cache.match(ids(12, start=100)) == 0


def test_a_prompt_reuses_the_full_pages_it_shares_with_a_cached_one():
    cache = PrefixCache(capacity_tokens=1000, page_size=PAGE)
    cache.insert(ids(12))
    assert cache.match([*ids(10), 99, 98, 97]) == 8


def test_the_last_prompt_token_is_always_computed():
    cache = PrefixCache(capacity_tokens=1000, page_size=PAGE)
    cache.insert(ids(12))
    assert cache.match(ids(12)) == 8


def test_the_least_recently_used_prefix_is_evicted_at_capacity():
    cache = PrefixCache(capacity_tokens=16, page_size=PAGE)
    old, recent, new = ids(9, start=0), ids(9, start=100), ids(9, start=200)
    cache.insert(old)
    cache.insert(recent)
    cache.match(recent)
    cache.insert(new)
    assert cache.match(old) == 0
    assert cache.match(recent) == 8
    assert cache.match(new) == 8
    assert cache.cached_tokens <= 16


def test_eviction_takes_the_tail_of_a_prefix_before_its_head():
    cache = PrefixCache(capacity_tokens=12, page_size=PAGE)
    cache.insert(ids(13))
    cache.insert(ids(5, start=500))
    assert cache.match(ids(13)) == 8


def test_clear_forgets_every_prefix():
    cache = PrefixCache(capacity_tokens=1000, page_size=PAGE)
    cache.insert(ids(12))
    cache.clear()
    assert cache.match(ids(12)) == 0
    assert cache.cached_tokens == 0


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def pd(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=1)


async def generate(client, cluster, text: str) -> tuple[dict, dict]:
    prefill, decode = cluster.prefill_urls[0], cluster.decode_urls[0]
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    p, d = await pd_generate(client, prefill, decode, cluster.bootstrap_port(prefill), body)
    return p.json()["meta_info"], d.json()["meta_info"]


async def flush(client, cluster) -> None:
    for url in cluster.urls:
        assert (await client.post(url + "/flush_cache")).status_code == 200


async def test_a_shared_prefix_is_reported_as_cached_by_prefill_and_decode(pd, client):
    await flush(client, pd)
    first, _ = await generate(client, pd, SYSTEM + "Alpha?")
    p_meta, d_meta = await generate(client, pd, SYSTEM + "Beta?")
    assert first["cached_tokens"] == 0
    assert len(SYSTEM) - 16 < p_meta["cached_tokens"] <= len(SYSTEM)
    assert d_meta["cached_tokens"] == p_meta["cached_tokens"]


async def test_flush_cache_empties_the_prefix_cache(pd, client):
    await generate(client, pd, SYSTEM + "Before the flush?")
    await flush(client, pd)
    p_meta, d_meta = await generate(client, pd, SYSTEM + "After the flush?")
    assert p_meta["cached_tokens"] == d_meta["cached_tokens"] == 0


async def test_loads_report_the_share_of_prompt_tokens_served_from_cache(pd, client):
    await generate(client, pd, SYSTEM + "Load one?")
    await generate(client, pd, SYSTEM + "Load two?")
    reply = await client.get(pd.prefill_urls[0] + "/v1/loads")
    rate = reply.json()["loads"][0]["cache_hit_rate"]
    assert 0.2 < rate < 1.0
    metrics = (await client.get(pd.prefill_urls[0] + "/metrics")).text
    assert "sglang:cached_tokens_total{" in metrics


@pytest.fixture(scope="module")
def slow_prefill(module_cluster_factory):
    """Prefill at modeled real time, 1 ms per prompt token: a 1500-token prompt takes 1.5 s."""
    return module_cluster_factory(
        prefill=1, decode=1, speed=1.0, prefill_secs_per_token=0.001, decode_step_base_secs=0.0
    )


async def test_a_cached_prefix_is_not_prefilled_again(slow_prefill, client):
    prefix = "x" * 1500

    async def timed(text: str) -> float:
        started = time.monotonic()
        await generate(client, slow_prefill, text)
        return time.monotonic() - started

    cold = await timed(prefix + "first")
    warm = await timed(prefix + "second")
    assert cold >= 1.5
    assert warm < cold / 2


def test_peek_answers_like_match_without_changing_what_is_evicted():
    cache = PrefixCache(capacity_tokens=8, page_size=4)
    old, new = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    cache.insert(old)
    cache.insert(new)
    assert cache.peek([*old, 99]) == 4
    cache.insert([11, 12, 13, 14, 15])
    assert cache.peek([*old, 99]) == 0
    assert cache.peek([*new, 99]) == 4
