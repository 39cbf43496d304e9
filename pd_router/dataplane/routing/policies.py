"""Selection policies: which worker of a pool gets the next request.

A policy sees only the selectable workers of one role (ACTIVE, healthy, circuit closed) and picks
one. Each pool has its own policy instance, so round-robin keeps one cursor per pool and
cache-aware one tree per pool. A policy that keys on the prompt says so with ``needs_prompt``;
the router computes the prompt key (:func:`prompt_key`) only for those. New policies implement
:class:`Policy` and register in :data:`POLICIES`; the names the peers (sglang-router, smg)
accept for policies pd-router does not have map to the closest one in :data:`POLICY_ALIASES`,
with the reason in :data:`ALIAS_REASONS`.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from pd_router.dataplane.routing.radix_tree import ApproxRadixTree
from pd_router.dataplane.routing.target import Target


@dataclass(frozen=True)
class CacheAwareConfig:
    """``[cache_aware]``: smg's cache-aware knobs, with its meanings and defaults."""

    # Route to the best-matching worker only when the matched share of the prompt exceeds this.
    cache_threshold: float = 0.3
    # Loads are imbalanced when max - min exceeds this AND max exceeds rel * min.
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # Every this many seconds the tree is trimmed to max_tree_size characters (0: never).
    eviction_interval_secs: float = 120.0
    max_tree_size: int = 67108864


class Policy(Protocol):
    name: str
    needs_prompt: bool

    def select(self, workers: Sequence[Target], prompt: str = "") -> Target:
        """Pick one of ``workers`` (never empty); ``prompt`` is the request's prompt key when
        :attr:`needs_prompt`, else empty."""
        ...

    def forget(self, url: str) -> None:
        """The worker at ``url`` left this pool (removed, or moved to the other role): drop
        what the policy keeps about it."""
        ...


class RandomPolicy:
    """Uniformly random, as SGLang's mini_lb does."""

    name = "random"
    needs_prompt = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[Target], prompt: str = "") -> Target:
        return workers[int(self._rng.random() * len(workers))]

    def forget(self, url: str) -> None:
        return None


class RoundRobinPolicy:
    """Each selectable worker in turn; the cursor survives pool changes."""

    name = "round_robin"
    needs_prompt = False

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers: Sequence[Target], prompt: str = "") -> Target:
        worker = workers[self._next % len(workers)]
        self._next = (self._next + 1) % (1 << 30)
        return worker

    def forget(self, url: str) -> None:
        return None


class LeastInflightPolicy:
    """Power of two choices on the router's in-flight counts: two random candidates, the less
    loaded wins. Nearly as good as scanning for the minimum, without herding every router
    instance onto the same idle worker."""

    name = "least_inflight"
    needs_prompt = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[Target], prompt: str = "") -> Target:
        count = len(workers)
        if count == 1:
            return workers[0]
        draw = self._rng.random
        first = int(draw() * count)
        second = int(draw() * (count - 1))
        if second >= first:
            second += 1
        a, b = workers[first], workers[second]
        return b if b.inflight < a.inflight else a

    def forget(self, url: str) -> None:
        return None


class PowerOfTwoPolicy(LeastInflightPolicy):
    """The peers' ``power_of_two``: two random candidates, the one with fewer requests in
    flight through this router (the same choice as ``least_inflight``, under their name)."""

    name = "power_of_two"


class LeastLoadPolicy:
    """smg's ``least_load`` on what the workers report about themselves: the worker with the
    fewest requests by its own last report (running + waiting, summed over its DP ranks;
    :mod:`pd_router.control.load_poller`) plus the requests this policy sent it since that
    report was read, so a burst between two reports still spreads; on a tie, the one with
    fewer requests in flight through the router, then one of those at random. A worker with
    no report (it did not answer, or none came yet) is judged by its in-flight count alone.
    With several data planes each counts what it sent itself; the in-flight tie-break sees
    the whole router's."""

    name = "least_load"
    needs_prompt = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        # Per worker: (when the report counted from was read, requests sent since).
        self._sent: dict[str, tuple[float, int]] = {}

    def select(self, workers: Sequence[Target], prompt: str = "") -> Target:
        sent = self._sent
        draw = self._rng.random
        best = workers[0]
        best_estimate = best_inflight = -1
        ties = 0
        # One pass, no tuple per worker: a pool is scanned whole at every pick.
        for worker in workers:
            inflight = worker.inflight
            estimate = worker.load
            if estimate is None:
                estimate = inflight
            elif sent:
                mark = sent.get(worker.url)
                if mark is not None and mark[0] == worker.load_at:
                    estimate += mark[1]
            if (
                ties == 0
                or estimate < best_estimate
                or (estimate == best_estimate and inflight < best_inflight)
            ):
                best, best_estimate, best_inflight, ties = worker, estimate, inflight, 1
            elif estimate == best_estimate and inflight == best_inflight:
                ties += 1
                if draw() * ties < 1:
                    best = worker
        if best.load is not None:
            mark = sent.get(best.url)
            count = mark[1] if mark is not None and mark[0] == best.load_at else 0
            sent[best.url] = (best.load_at, count + 1)
        return best

    def forget(self, url: str) -> None:
        self._sent.pop(url, None)


class CacheAwarePolicy:
    """smg's ``cache_aware``. While loads are balanced, the prompt goes to the worker that was
    sent the longest prefix of it, if that prefix is more than ``cache_threshold`` of the
    prompt (its KV is likely still cached there); otherwise, and whenever the loads (requests
    in flight) are imbalanced, to the least loaded worker, the one with the smaller tree on a
    tie (most cache room). The prompt is then recorded under the chosen worker. The tree is
    trimmed to ``max_tree_size`` at the first pick after each ``eviction_interval_secs``."""

    name = "cache_aware"
    needs_prompt = True

    def __init__(
        self,
        config: CacheAwareConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        shared: bool = False,
    ) -> None:
        self._config = config
        self._clock = clock
        self._shared = shared
        self._tree = ApproxRadixTree()
        self._next_eviction = clock() + config.eviction_interval_secs

    @property
    def tree(self) -> ApproxRadixTree:
        return self._tree

    def select(self, workers: Sequence[Target], prompt: str = "") -> Target:
        now = self._clock()
        interval = self._config.eviction_interval_secs
        if interval > 0 and now >= self._next_eviction:
            self._tree.evict(self._config.max_tree_size)
            self._next_eviction = now + interval
        chosen = self._choose(workers, prompt)
        self._tree.insert(prompt, chosen.url, now)
        return chosen

    def forget(self, url: str) -> None:
        self._tree.remove_tenant(url)

    def _choose(self, workers: Sequence[Target], prompt: str) -> Target:
        if len(workers) == 1:
            return workers[0]
        if self._imbalanced(workers) or not prompt:
            return self._least_loaded(workers)
        by_url = {w.url: w for w in workers}
        tenant, matched = self._tree.match(prompt, by_url)
        if tenant is not None and matched / len(prompt) > self._config.cache_threshold:
            return by_url[tenant]
        if self._shared:
            return placed(workers, prompt, self._config.cache_threshold)
        return self._least_loaded(workers)

    def _imbalanced(self, workers: Sequence[Target]) -> bool:
        loads = [w.inflight for w in workers]
        low, high = min(loads), max(loads)
        config = self._config
        return (
            high - low > config.balance_abs_threshold and high > config.balance_rel_threshold * low
        )

    def _least_loaded(self, workers: Sequence[Target]) -> Target:
        tree = self._tree
        return min(workers, key=lambda w: (w.inflight, tree.tenant_size(w.url)))


def placed(workers: Sequence[Target], prompt: str, threshold: float) -> Target:
    """The worker a new prefix goes to when several processes route: rendezvous hashing of
    the prompt's head over the workers' urls. Each data plane has its own tree, and the least
    loaded worker in one process's view is not that of another's; placed so, a prefix goes
    to the same worker whichever process sees it first, the trees agree, and its later
    requests find its KV wherever they arrive. The head is the share of the prompt a match
    must exceed (``threshold``) rounded down to a power of two, so prompts that share enough
    of a prefix to be matched to each other share a head (a conversation stays on its worker
    while it grows up to twice as long)."""
    share = max(1, int(len(prompt) * threshold))
    head = zlib.crc32(prompt[: 1 << (share.bit_length() - 1)].encode())
    return max(workers, key=lambda w: zlib.crc32(w.url.encode(), head))


Factory = Callable[[CacheAwareConfig, bool], Policy]
POLICIES: Mapping[str, Factory] = MappingProxyType(
    {
        "random": lambda _, __: RandomPolicy(),
        "round_robin": lambda _, __: RoundRobinPolicy(),
        "least_inflight": lambda _, __: LeastInflightPolicy(),
        "least_load": lambda _, __: LeastLoadPolicy(),
        "power_of_two": lambda _, __: PowerOfTwoPolicy(),
        "cache_aware": lambda config, shared: CacheAwarePolicy(config, shared=shared),
    }
)

# Every other name sglang-router 0.3.2 or smg 1.13 accepts, mapped to the closest policy.
POLICY_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "manual": "cache_aware",
        "consistent_hashing": "cache_aware",
        "prefix_hash": "cache_aware",
        "bucket": "least_inflight",
        "passthrough": "least_inflight",
    }
)

ALIAS_REASONS: Mapping[str, str] = MappingProxyType(
    {
        "manual": "pd-router reads no routing-key header to pin sessions; cache_aware keeps "
        "requests that share a prefix (a conversation) on one worker instead",
        "consistent_hashing": "pd-router hashes no routing key onto a ring; cache_aware keeps "
        "requests that share a prefix on one worker instead",
        "prefix_hash": "pd-router hashes no fixed-length prompt head onto a ring; cache_aware "
        "matches the whole prefix in a radix tree to the same end",
        "bucket": "pd-router does not split prefills into prompt-length buckets; "
        "least_inflight balances them by requests in flight",
        "passthrough": "pd-router always chooses the worker itself; least_inflight balances "
        "requests in flight",
    }
)


def canonical_policy_name(name: str) -> str:
    """The registered name for ``name`` (an alias maps to its policy); KeyError if unknown."""
    name = POLICY_ALIASES.get(name, name)
    if name not in POLICIES:
        raise KeyError(name)
    return name


def alias_warning(name: str) -> str | None:
    """For a peer's policy name that pd-router runs as another policy, one sentence saying
    which and why; None for a real policy (and for an unknown name)."""
    reason = ALIAS_REASONS.get(name)
    if reason is None:
        return None
    return f"policy {name!r} runs as {POLICY_ALIASES[name]!r}: {reason}"


def make_policy(
    name: str, cache_aware: CacheAwareConfig | None = None, *, shared: bool = False
) -> Policy:
    """Policy ``name``; ``shared``: for one of several processes routing the same pools."""
    return POLICIES[canonical_policy_name(name)](cache_aware or CacheAwareConfig(), shared)


def prompt_key(body: Mapping[str, Any]) -> str:
    """What a prompt-aware policy keys on: ``/generate``'s ``text`` or ``input_ids``, OpenAI's
    ``prompt``, or the chat ``messages`` joined (role and text of each); the first prompt of a
    batch. Token ids become one character each, so prefixes of ids stay prefixes."""
    for field in ("text", "prompt", "input_ids"):
        value = body.get(field)
        if value is not None:
            return _single_key(value)
    messages = body.get("messages")
    return _messages_key(messages) if isinstance(messages, list) else ""


def _single_key(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(chr(t % 0x110000) for t in value if isinstance(t, int))
    return ""


def _messages_key(messages: list[Any]) -> str:
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        if isinstance(content, str):
            parts.append(f"{message.get('role')}\n{content}\n")
    return "".join(parts)
