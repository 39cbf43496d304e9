"""The worker's prefix cache: which prompt prefixes still have their KV on this worker.

SGLang keeps the KV of finished prompts in a radix tree and reuses the longest cached prefix of a
new prompt, so only the rest is prefilled. This model keeps the same answer at page granularity:
a prompt is cut into pages of :data:`PAGE_SIZE` tokens, each page is keyed by a hash of every
token up to its end (so a key names a whole prefix, as a radix-tree path does), and the keys live
in one LRU bounded by the KV capacity in tokens. A lookup walks the pages from the first and
stops at the first page not cached; the last prompt token is never served from the cache (SGLang
always computes it to produce the first output token).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence

PAGE_SIZE = 16


class PrefixCache:
    """An LRU of prompt pages keyed by the prefix that ends with them."""

    def __init__(self, capacity_tokens: int, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size
        self.max_pages = max(1, capacity_tokens // page_size)
        self._pages: collections.OrderedDict[int, None] = collections.OrderedDict()

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV the cache holds (all pages are full)."""
        return len(self._pages) * self.page_size

    def match(self, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of ``prompt_ids`` are cached (a multiple of the page size,
        below the prompt length). The matched pages become the most recently used."""
        hit = self._hit_pages(prompt_ids)
        self._touch(hit)
        return len(hit) * self.page_size

    def peek(self, prompt_ids: Sequence[int]) -> int:
        """What :meth:`match` would answer now, without marking any page used (a load report
        must not change what the cache evicts)."""
        return len(self._hit_pages(prompt_ids)) * self.page_size

    def _hit_pages(self, prompt_ids: Sequence[int]) -> list[int]:
        hit: list[int] = []
        for key in self._keys(prompt_ids, len(prompt_ids) - 1):
            if key not in self._pages:
                break
            hit.append(key)
        return hit

    def insert(self, prompt_ids: Sequence[int]) -> None:
        """Cache every full page of a prefilled prompt, evicting the least recently used pages
        beyond the capacity."""
        self._touch(list(self._keys(prompt_ids, len(prompt_ids))))
        while len(self._pages) > self.max_pages:
            self._pages.popitem(last=False)

    def clear(self) -> None:
        """``/flush_cache``: forget every page."""
        self._pages.clear()

    def _touch(self, keys: list[int]) -> None:
        """Mark ``keys`` (a prefix's pages, first to last) used now. The first page ends most
        recent, so eviction takes the tails of prefixes before the pages they hang from."""
        for key in reversed(keys):
            self._pages[key] = None
            self._pages.move_to_end(key)

    def _keys(self, prompt_ids: Sequence[int], limit: int) -> Iterator[int]:
        """The key of each full page within the first ``limit`` tokens."""
        key = 0
        size = self.page_size
        for start in range(0, limit - size + 1, size):
            key = hash((key, tuple(prompt_ids[start : start + size])))
            yield key
