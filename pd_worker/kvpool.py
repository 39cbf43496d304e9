"""The KV cache token pool: a FIFO-fair counting allocator that survives role switches."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable


class KVPool:
    """Token slots of the KV cache. Requests that do not fit wait in arrival order."""

    def __init__(self, capacity: int, on_change: Callable[[], None]) -> None:
        self.capacity = capacity
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._on_change = on_change

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def usage(self) -> float:
        return self.used / self.capacity

    async def acquire(self, tokens: int) -> None:
        """Take ``tokens`` slots, waiting (FIFO) while the pool is full."""
        if not self._waiters and self.used + tokens <= self.capacity:
            self.used += tokens
            self._on_change()
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (tokens, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(tokens)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._grant()
            raise

    def release(self, tokens: int) -> None:
        """Give back slots and admit waiters that now fit."""
        self.used -= tokens
        self._grant()
        self._on_change()

    def clear(self) -> None:
        """flush_cache: the prefix cache holds no pool slots, so only waiters are re-checked."""
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            tokens, future = self._waiters.popleft()
            if not future.done():
                self.used += tokens
                future.set_result(None)
