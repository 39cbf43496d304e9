"""The pause between retries of a background loop (etcd, discovery, a worker's registration,
a conversion's polls): it doubles after every
failure, up to a cap, so a dependency that is down is not hammered, and starts small again
after a success, so a short outage is noticed soon after it ends.

Request retries have their own configurable, jittered schedule
(:mod:`pd_router.dataplane.routing.retry`).
"""

from __future__ import annotations

import asyncio


class Backoff:
    """Pauses that grow from ``first_secs`` by ``factor`` up to ``max_secs``."""

    def __init__(self, first_secs: float, max_secs: float, factor: float = 2.0) -> None:
        self.first_secs = first_secs
        self.max_secs = max_secs
        self.factor = factor
        self.secs = first_secs
        """The pause the next :meth:`sleep` takes (what a log line says it will wait)."""

    def reset(self) -> None:
        """After a success: the next pause is the first one again."""
        self.secs = self.first_secs

    def take(self) -> float:
        """The pause to wait now; the one after it is longer, up to the cap."""
        secs = self.secs
        self.secs = min(secs * self.factor, self.max_secs)
        return secs

    async def sleep(self) -> None:
        """Wait the next pause."""
        await asyncio.sleep(self.take())
