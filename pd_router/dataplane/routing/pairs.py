"""Prefill/decode pairs whose rendezvous failed: kept apart until something changed.

A request meets at a rendezvous: the decode reaches the prefill's bootstrap endpoint and pulls
the KV. SGLang 0.5.23 can break one pair while both workers stay healthy: a decode caches each
prefill's KV endpoint and never drops it while that prefill's bootstrap server answers, so after
the prefill went prefill -> decode -> prefill (a rebuilt KV manager on a new port) the decode
keeps knocking on the old one and every request of that pair hangs. The other pairs of the two
workers are fine. A leg that misses the rendezvous wait (``legs.rendezvous_timeout_secs``) is
the pair's failure, not a worker's: the circuits do not see it, :class:`PairQuarantine` does.

How it decides whether a pair may be picked:

- A pair that missed a rendezvous is **quarantined** for ``cooldown_secs``: the proxy avoids its
  decode for that prefill (the decode stays free for every other prefill).
- It is released at once when either side is no longer the worker it failed with: another
  object (removed and added again), another role, or another epoch (a role change through a
  conversion or one the router adopted), as the data plane's snapshot says.
- After the cool-down the pair is **half-open**: one attempt may go through it (the trial);
  while it runs the pair stays avoided. A trial that meets releases the pair; one that misses
  quarantines it for another cool-down; one that ends otherwise (client gone, another failure)
  leaves it half-open for the next request.

Each data plane keeps its own quarantine (as it keeps its own connection pool): what one of them
learnt the others learn from their own requests, one wait each at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pd_router.dataplane.routing.target import Target

Stamp = tuple[Any, Any]


def stamp(worker: Target) -> Stamp:
    """What tells that a worker is still the one a pair failed with: its role and, where the
    worker object has one (a snapshot's member, the registry's worker), its epoch."""
    return worker.role, getattr(worker, "epoch", None)


@dataclass(slots=True)
class _Entry:
    prefill: Target
    decode: Target
    prefill_stamp: Stamp
    decode_stamp: Stamp
    until: float  # end of the cool-down (monotonic)
    trial: bool = False


class PairQuarantine:
    """The pairs of this process that missed a rendezvous (see the module docstring)."""

    def __init__(self, cooldown_secs: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_secs = cooldown_secs
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def stuck(self, prefill: Target, decode: Target) -> None:
        """The pair missed its rendezvous: quarantine it for a cool-down."""
        self._entries[prefill.url, decode.url] = _Entry(
            prefill, decode, stamp(prefill), stamp(decode), self._clock() + self.cooldown_secs
        )

    def met(self, prefill: Target, decode: Target) -> None:
        """The pair met (the prefill answered or the decode's first byte came): release it."""
        if self._entries:
            self._entries.pop((prefill.url, decode.url), None)

    def avoid(self, prefill: Target, avoid: Sequence[Target]) -> Sequence[Target]:
        """``avoid`` plus the decodes that ``prefill`` must not be paired with now."""
        if not self._entries:
            return avoid
        blocked = [entry.decode for entry in self._blocking(prefill)]
        return [*avoid, *blocked] if blocked else avoid

    def blocks(self, prefill: Target, decode: Target) -> bool:
        """Whether the pair is quarantined now (the pick had nothing else left)."""
        if not self._entries:
            return False
        return any(entry.decode is decode for entry in self._blocking(prefill))

    def dispatch(self, prefill: Target, decode: Target) -> bool:
        """An attempt goes through the pair; True when it is a half-open pair's trial (the
        caller ends it with :meth:`end_trial`)."""
        if not self._entries:
            return False
        key = (prefill.url, decode.url)
        entry = self._current(key, prefill)
        if entry is not None and entry.decode is not decode:
            del self._entries[key]
            return False
        if entry is None or entry.trial or self._clock() < entry.until:
            return False
        entry.trial = True
        return True

    def end_trial(self, prefill: Target, decode: Target) -> None:
        """The trial's attempt ended; a pair neither met nor stuck stays half-open."""
        entry = self._entries.get((prefill.url, decode.url))
        if entry is not None:
            entry.trial = False

    def _blocking(self, prefill: Target) -> list[_Entry]:
        """The entries that keep a decode away from ``prefill`` now."""
        now = self._clock()
        keys = [key for key in self._entries if key[0] == prefill.url]
        return [
            entry
            for key in keys
            if (entry := self._current(key, prefill)) is not None
            and (entry.trial or now < entry.until)
        ]

    def _current(self, key: tuple[str, str], prefill: Target) -> _Entry | None:
        """The pair's entry, dropped (None) when either side changed since it failed."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if (
            entry.prefill is not prefill
            or stamp(prefill) != entry.prefill_stamp
            or stamp(entry.decode) != entry.decode_stamp
        ):
            del self._entries[key]
            return None
        return entry
