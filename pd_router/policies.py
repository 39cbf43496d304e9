"""Selection policies: which worker of a pool gets the next request.

A policy sees only the selectable workers of one role (ACTIVE, healthy, circuit closed) and picks
one. Each pool has its own policy instance, so round-robin keeps one cursor per pool. New policies
implement :class:`Policy` and register in :data:`POLICIES`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from pd_router.workers import Worker


class Policy(Protocol):
    name: str

    def select(self, workers: Sequence[Worker]) -> Worker:
        """Pick one of ``workers`` (never empty)."""
        ...


class RandomPolicy:
    """Uniformly random, as SGLang's mini_lb does."""

    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[Worker]) -> Worker:
        return workers[int(self._rng.random() * len(workers))]


class RoundRobinPolicy:
    """Each selectable worker in turn; the cursor survives pool changes."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, workers: Sequence[Worker]) -> Worker:
        worker = workers[self._next % len(workers)]
        self._next = (self._next + 1) % (1 << 30)
        return worker


class LeastInflightPolicy:
    """Power of two choices on the router's in-flight counts: two random candidates, the less
    loaded wins. Nearly as good as scanning for the minimum, without herding every router
    instance onto the same idle worker."""

    name = "least_inflight"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, workers: Sequence[Worker]) -> Worker:
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


POLICIES: Mapping[str, Callable[[], Policy]] = MappingProxyType(
    {
        "random": RandomPolicy,
        "round_robin": RoundRobinPolicy,
        "least_inflight": LeastInflightPolicy,
    }
)

# Names accepted for compatibility with sglang_router's command line.
POLICY_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "power_of_two": "least_inflight",
        "cache_aware": "least_inflight",
    }
)


def canonical_policy_name(name: str) -> str:
    """The registered name for ``name`` (an alias maps to its policy); KeyError if unknown."""
    name = POLICY_ALIASES.get(name, name)
    if name not in POLICIES:
        raise KeyError(name)
    return name


def make_policy(name: str) -> Policy:
    return POLICIES[canonical_policy_name(name)]()
