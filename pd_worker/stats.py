"""Cumulative counters and the generation-throughput window, read by /v1/loads and /metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

THROUGHPUT_WINDOW_SECS = 5


@dataclass
class EngineStats:
    """Counters that only grow, like SGLang's ``sglang:*_total`` metrics."""

    num_requests: int = 0
    num_aborted_requests: int = 0
    num_bootstrap_failed_reqs: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_secs: float = 0.0
    prefill_uncached_tokens: int = 0
    prefill_busy_us: int = 0
    decode_moments: list[float] = field(default_factory=lambda: [0.0] * 6)
    _buckets: dict[int, int] = field(default_factory=dict)

    def count_generated(self, tokens: int) -> None:
        self.generation_tokens += tokens
        second = int(time.monotonic())
        self._buckets[second] = self._buckets.get(second, 0) + tokens
        if len(self._buckets) > THROUGHPUT_WINDOW_SECS + 1:
            for old in [s for s in self._buckets if s < second - THROUGHPUT_WINDOW_SECS]:
                del self._buckets[old]

    def gen_throughput(self) -> float:
        """Generated tokens per second over the last few whole seconds."""
        now = int(time.monotonic())
        recent = sum(n for s, n in self._buckets.items() if now - THROUGHPUT_WINDOW_SECS <= s < now)
        return recent / THROUGHPUT_WINDOW_SECS

    def count_prefill(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One prompt prefilled, ``cached_tokens`` of it served by the prefix cache."""
        self.prefill_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def cache_hit_rate(self) -> float:
        """Share of prefilled prompt tokens the prefix cache served, since start-up."""
        if self.prefill_tokens <= 0:
            return 0.0
        return self.cached_tokens / self.prefill_tokens

    def count_prefill_forward(self, uncached_tokens: int, busy_us: int) -> None:
        """One prefill forward over ``uncached_tokens`` tokens that kept the GPU busy for
        ``busy_us`` microseconds (SGLang's ``total_prefill_*`` capacity counters)."""
        self.prefill_uncached_tokens += uncached_tokens
        self.prefill_busy_us += busy_us

    def count_decode_step(self, batch_size: int, step_us: float) -> None:
        """One request's token from a decode step of ``batch_size`` running requests that took
        ``step_us`` microseconds. Requests step on their own here, so each stands for 1/b of a
        batch step: b such calls add to SGLang's moment sums ``[n, Σb, Σt, Σb², Σb·t, Σg]``
        what one batch step of b requests adds there."""
        b = max(batch_size, 1)
        share = (1 / b, 1.0, step_us / b, float(b), step_us, 1.0)
        self.decode_moments = [
            total + part for total, part in zip(self.decode_moments, share, strict=True)
        ]

    def decode_moments_or_none(self) -> list[float] | None:
        """The decode moment sums, or None before any decode step (as SGLang reports them)."""
        return list(self.decode_moments) if self.decode_moments[0] > 0 else None

    def count_transfer(self, nbytes: int, secs: float) -> None:
        self.kv_transfer_bytes += nbytes
        self.kv_transfer_secs += secs

    def kv_transfer_speed_gb_s(self) -> float:
        if self.kv_transfer_secs <= 0:
            return 0.0
        return self.kv_transfer_bytes / self.kv_transfer_secs / 1e9
