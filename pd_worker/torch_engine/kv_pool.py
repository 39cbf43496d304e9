"""The KV pool: one tensor allocated at start-up, holding every token's keys and values.

A slot is one token's K and V for every layer, contiguous (``[num_layers, 2, num_kv_heads,
head_dim]``), so a run of consecutive slots is one byte range of the tensor: what a transfer
engine registers and copies. The tensor is never reallocated: a role switch keeps it (same
``data_ptr``), as SGLang keeps its memory pool across ``role_switch``.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from pd_worker.torch_engine.config import ModelConfig


class PoolExhausted(Exception):
    """Fewer free slots than a request needs; nothing was allocated."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: {requested} slots requested, {free} free")
        self.requested = requested
        self.free = free


class SlotError(ValueError):
    """A slot number outside the pool, or freed while not allocated."""


class KVPool:
    """Slot allocator over the preallocated ``kv`` tensor. Not thread-safe: one owner (the
    worker's event loop) allocates and frees; model steps only read and write slot contents."""

    def __init__(self, config: ModelConfig, num_slots: int, device: str | torch.device) -> None:
        if num_slots <= 0:
            raise SlotError(f"a pool needs slots, got {num_slots}")
        self.kv = torch.zeros(
            (num_slots, config.num_layers, 2, config.num_kv_heads, config.head_dim),
            dtype=getattr(torch, config.dtype),
            device=device,
        )
        self.num_slots = num_slots
        self.slot_bytes = self.kv[0].numel() * self.kv.element_size()
        # Lowest slots first, so a request's slots tend to form few contiguous byte ranges.
        self._free = list(range(num_slots))
        self._allocated = bytearray(num_slots)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def data_ptr(self) -> int:
        return self.kv.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots, all or none."""
        if n > len(self._free):
            raise PoolExhausted(n, len(self._free))
        slots = [heapq.heappop(self._free) for _ in range(n)]
        for slot in slots:
            self._allocated[slot] = 1
        return slots

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the pool; their contents stay until reused (nothing is zeroed)."""
        slots = list(slots)
        for slot in slots:
            self._check(slot)
            if not self._allocated[slot]:
                raise SlotError(f"slot {slot} is not allocated")
        for slot in slots:
            self._allocated[slot] = 0
            heapq.heappush(self._free, slot)

    def byte_ranges(self, slots: list[int]) -> list[tuple[int, int]]:
        """``(offset, length)`` from ``data_ptr`` of the slots' bytes, in the order given, one
        range per run of consecutive slot numbers."""
        ranges: list[tuple[int, int]] = []
        run_start = run_len = 0
        for slot in slots:
            self._check(slot)
            if run_len and slot == run_start + run_len:
                run_len += 1
                continue
            if run_len:
                ranges.append((run_start * self.slot_bytes, run_len * self.slot_bytes))
            run_start, run_len = slot, 1
        if run_len:
            ranges.append((run_start * self.slot_bytes, run_len * self.slot_bytes))
        return ranges

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlotError(f"slot {slot} is outside the pool of {self.num_slots}")
