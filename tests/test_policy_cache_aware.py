"""Cache-aware routing: the approximate radix tree and the policies on recorded inputs (real
Worker objects, a hand-driven clock), the prompt key of each request shape, the peers' policy
names, and through a real router: requests that share a long prefix land on the same prefill
and hit its prefix cache."""

from __future__ import annotations

import httpx
import pytest

from pd_router.circuit_state import CircuitState
from pd_router.config import ConfigError, load_config
from pd_router.control.workers import Role, Worker, WorkerRegistry
from pd_router.dataplane.routing.policies import (
    POLICIES,
    POLICY_ALIASES,
    CacheAwareConfig,
    CacheAwarePolicy,
    alias_warning,
    canonical_policy_name,
    make_policy,
    prompt_key,
)
from pd_router.dataplane.routing.radix_tree import ApproxRadixTree
from pd_router.dataplane.routing.snapshot import SnapshotPools
from pd_router.metrics import RouterMetrics
from pd_router.wire import Snapshot, WorkerEntry
from tests.router_helpers import assert_paired, generate_body, running_router

A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"
SYSTEM = "You are a terse assistant. Answer with one sentence and no preamble. " * 8
# The policy names of sglang-router 0.3.2 `launch_router --help` and smg 1.13 `smg launch --help`.
PEER_POLICIES = (
    "random", "round_robin", "cache_aware", "power_of_two", "manual", "bucket", "passthrough",
    "least_load", "consistent_hashing", "prefix_hash",
)  # fmt: skip


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def workers() -> list[Worker]:
    registry = WorkerRegistry(RouterMetrics())
    for url in (A, B, C):
        registry.add(url, Role.PREFILL)
    return registry.selectable(Role.PREFILL)


def load(worker: Worker, inflight: int) -> None:
    worker.inflight = inflight


def policy(clock: Clock | None = None, **config) -> CacheAwarePolicy:
    return CacheAwarePolicy(CacheAwareConfig(**config), clock or Clock())


# --- the tree -------------------------------------------------------------------------------


def test_match_names_the_tenant_with_the_longest_shared_prefix():
    tree = ApproxRadixTree()
    tree.insert("hello world", A, 1.0)
    tree.insert("hello there", B, 2.0)
    assert tree.match("hello world, again", {A, B}) == (A, 11)
    assert tree.match("hello there, again", {A, B}) == (B, 11)


def test_a_prompt_sharing_nothing_matches_no_tenant():
    tree = ApproxRadixTree()
    tree.insert("hello world", A, 1.0)
    assert tree.match("goodbye", {A}) == (None, 0)


def test_match_ignores_tenants_that_are_not_candidates():
    tree = ApproxRadixTree()
    tree.insert("hello world", A, 1.0)
    tree.insert("hello", B, 2.0)
    assert tree.match("hello world", {B}) == (B, 5)


def test_of_equal_prefixes_the_most_recent_tenant_wins():
    tree = ApproxRadixTree()
    tree.insert("shared prefix", A, 1.0)
    tree.insert("shared prefix", B, 2.0)
    assert tree.match("shared prefix!", {A, B}) == (B, 13)


def test_size_counts_each_tenants_characters_once():
    tree = ApproxRadixTree()
    tree.insert("hello world", A, 1.0)
    tree.insert("hello there", A, 2.0)
    tree.insert("hello world", B, 3.0)
    assert tree.tenant_size(A) == len("hello world") + len("there")
    assert tree.tenant_size(B) == len("hello world")
    assert tree.size == tree.tenant_size(A) + tree.tenant_size(B)


def test_evict_drops_least_recently_used_prompts_first():
    tree = ApproxRadixTree()
    tree.insert("old prompt", A, 1.0)
    tree.insert("new prompt", A, 2.0)
    tree.evict(max_size=len("new prompt"))
    assert tree.match("old prompt", {A}) == (None, 0)
    assert tree.match("new prompt", {A}) == (A, 10)


def test_evict_trims_a_prompts_tail_before_the_head_it_shares():
    tree = ApproxRadixTree()
    tree.insert("common head, tail one", A, 1.0)
    tree.insert("common head, tail two", A, 2.0)
    tree.evict(max_size=len("common head, tail two"))
    assert tree.match("common head, tail one", {A}) == (A, len("common head, tail "))
    assert tree.size == len("common head, tail two")


def test_removing_a_tenant_forgets_its_prefixes_and_keeps_the_others():
    tree = ApproxRadixTree()
    tree.insert("shared head, tail of A", A, 1.0)
    tree.insert("shared head, tail of B", B, 2.0)
    tree.insert("only A here", A, 3.0)
    tree.remove_tenant(A)
    assert tree.match("shared head, tail of A", {A, B}) == (B, len("shared head, tail of "))
    assert tree.match("only A here", {A, B}) == (None, 0)
    assert (tree.tenant_size(A), tree.size) == (0, len("shared head, tail of B"))


# --- the policy -----------------------------------------------------------------------------


def test_requests_sharing_a_long_prefix_follow_the_first_one(workers):
    cache_aware = policy()
    first = cache_aware.select(workers, SYSTEM + "first question")
    load(first, 3)
    picks = {cache_aware.select(workers, SYSTEM + f"question {i}").url for i in range(5)}
    assert picks == {first.url}


def test_a_new_prompt_goes_to_the_least_loaded_worker(workers):
    cache_aware = policy()
    cache_aware.select(workers, SYSTEM)
    load(workers[0], 2)
    load(workers[1], 1)
    load(workers[2], 3)
    assert cache_aware.select(workers, "an unrelated prompt").url == B


def test_a_match_below_the_cache_threshold_is_not_followed(workers):
    cache_aware = policy(cache_threshold=0.5)
    load(workers[1], 1)
    load(workers[2], 1)
    assert cache_aware.select(workers, "abcdefghij") is workers[0]
    load(workers[0], 1)
    load(workers[1], 0)
    assert cache_aware.select(workers, "abcdXXXXXXXXXX").url == B


def test_imbalanced_loads_override_the_prefix_match(workers):
    cache_aware = policy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    holder = cache_aware.select(workers, SYSTEM)
    load(holder, 10)
    others = [w for w in workers if w is not holder]
    load(others[0], 2)
    load(others[1], 5)
    assert cache_aware.select(workers, SYSTEM + "again") is others[0]


def test_imbalance_needs_both_the_absolute_and_the_relative_gap(workers):
    cache_aware = policy(balance_abs_threshold=4, balance_rel_threshold=2.0)
    holder = cache_aware.select(workers, SYSTEM)
    load(holder, 15)
    for other in workers:
        if other is not holder:
            load(other, 10)
    assert cache_aware.select(workers, SYSTEM + "again") is holder


def test_distinct_prefixes_spread_over_idle_workers(workers):
    cache_aware = policy()
    picks = {cache_aware.select(workers, f"{i} {SYSTEM}").url for i in range(3)}
    assert picks == {A, B, C}


def test_a_prefix_served_by_an_unselectable_worker_is_not_followed(workers):
    cache_aware = policy()
    holder = cache_aware.select(workers, SYSTEM)
    rest = [w for w in workers if w is not holder]
    assert cache_aware.select(rest, SYSTEM + "again") in rest


def test_the_tree_is_trimmed_once_per_eviction_interval(workers):
    clock = Clock()
    cache_aware = policy(clock, eviction_interval_secs=60.0, max_tree_size=100)
    for i in range(5):
        cache_aware.select(workers, f"{i}: {SYSTEM}")
    grown = cache_aware.tree.size
    clock.now += 59.0
    cache_aware.select(workers, "x")
    assert cache_aware.tree.size > grown
    clock.now += 1.0
    cache_aware.select(workers, "y")
    assert cache_aware.tree.size <= 100 + len("y")


# --- prompt keys and names ------------------------------------------------------------------


def test_prompt_key_of_each_request_shape():
    assert prompt_key({"text": "hello"}) == "hello"
    assert prompt_key({"text": ["first", "second"]}) == "first"
    assert prompt_key({"prompt": "hello"}) == "hello"
    assert prompt_key({"messages": [{"role": "system", "content": "be brief"}]}) == (
        "system\nbe brief\n"
    )
    assert prompt_key({"max_tokens": 3}) == ""


def test_token_id_prefixes_stay_prefixes_in_the_key():
    short = prompt_key({"input_ids": [5, 6, 7]})
    long = prompt_key({"input_ids": [5, 6, 7, 8]})
    assert len(long) == 4
    assert long.startswith(short)
    assert prompt_key({"prompt": [[5, 6], [7]]}) == prompt_key({"input_ids": [5, 6]})


def test_only_cache_aware_needs_the_prompt():
    needing = {name for name in POLICIES if make_policy(name).needs_prompt}
    assert needing == {"cache_aware"}


@pytest.mark.parametrize("name", PEER_POLICIES)
def test_every_peer_policy_name_runs_a_policy(name):
    assert canonical_policy_name(name) in POLICIES


def test_a_real_policy_has_no_alias_warning():
    assert {name: alias_warning(name) for name in POLICIES} == dict.fromkeys(POLICIES)


@pytest.mark.parametrize("name", sorted(POLICY_ALIASES))
def test_an_alias_warning_names_the_policy_that_runs(name):
    warning = alias_warning(name)
    assert warning is not None
    assert f"runs as {POLICY_ALIASES[name]!r}" in warning


# --- through the router ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=1, speed=0.0)


async def test_requests_sharing_a_prefix_hit_one_prefills_cache(cluster):
    async with httpx.AsyncClient(timeout=10.0) as plain:
        for url in cluster.urls:
            await plain.post(url + "/flush_cache")
    groups = {"alpha": "A" + SYSTEM, "beta": "B" + SYSTEM}
    async with (
        running_router(cluster, policy="cache_aware") as router,
        router.client() as http,
    ):
        served: dict[str, set[str]] = {name: set() for name in groups}
        cached: list[int] = []
        for i in range(4):
            for name, prefix in groups.items():
                prompt = f"{prefix} question {i}?"
                reply = (await http.post("/generate", json=generate_body(prompt, 2))).json()
                served[name].add(assert_paired(reply, prompt, 2))
                if i > 0:
                    cached.append(reply["meta_info"]["cached_tokens"])
    assert [len(urls) for urls in served.values()] == [1, 1]
    assert served["alpha"] != served["beta"]
    assert min(cached) >= len(SYSTEM) - 16


def snapshot_entry(url: str, role: Role) -> WorkerEntry:
    """A pickable worker as a snapshot carries it."""
    return WorkerEntry(url, role, "", 0, None, True, True, CircuitState.CLOSED, None, None)


def test_a_worker_that_leaves_a_pool_leaves_that_pools_cache_aware_tree():
    policies = {role: CacheAwarePolicy(CacheAwareConfig(), Clock()) for role in Role}
    pools = SnapshotPools(
        policies, index=0, wake=lambda: None, suspect=lambda url: None,
        stuck=lambda prefill, decode: None,
        on_unavailable=lambda url: None, count_refusal=lambda role, model: None,
    )  # fmt: skip
    pools.apply(Snapshot(1, tuple(snapshot_entry(url, Role.PREFILL) for url in (A, B, C))))
    for url in (A, B, C):
        policies[Role.PREFILL].select([pools.member(url)], f"{url} prompt")
    # A moved to the decode pool, B was removed, C stayed.
    pools.apply(Snapshot(2, (snapshot_entry(A, Role.DECODE), snapshot_entry(C, Role.PREFILL))))
    tree = policies[Role.PREFILL].tree
    assert [tree.tenant_size(url) for url in (A, B, C)] == [0, 0, len(f"{C} prompt")]


# --- configuration --------------------------------------------------------------------------


def test_the_cache_aware_section_is_read_with_smg_defaults_for_the_rest():
    config = load_config(None, {"policy": "cache_aware", "cache_aware": {"cache_threshold": 0.5}})
    assert config.cache_aware.cache_threshold == 0.5
    assert config.cache_aware.balance_abs_threshold == 64


@pytest.mark.parametrize(
    "section",
    [{"cache_threshold": 1.5}, {"balance_rel_threshold": 0.5}, {"max_tree_size": 0}],
)
def test_a_cache_aware_value_out_of_range_is_refused(section):
    with pytest.raises(ConfigError):
        load_config(None, {"cache_aware": section})
