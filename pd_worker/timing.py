"""Timing model of a PD worker: how long prefill, decode steps and KV transfers take.

Defaults loosely follow an 8B model on one modern GPU; :data:`PROFILES` holds named sets of
knobs calibrated to published figures (``h100-8b``: Llama-3.1-8B in BF16 on one H100 SXM, the
sources in docs/PERFORMANCE.md, "Timing model"). Every modeled duration is multiplied by
``speed`` before sleeping: 1.0 is modeled real time, 0.1 runs ten times faster, and 0 removes
artificial delays entirely (benchmarks and fast tests). Capacities (KV tokens, running requests,
prefill token budget) are not scaled, so queueing and saturation behave the same at every speed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class TimingModel:
    """Knobs of the simulated GPU; field names are also CLI flags (``--max-running-requests``)."""

    speed: float = 1.0
    prefill_secs_per_token: float = 0.00005
    prefill_batch_overhead_secs: float = 0.005
    max_prefill_tokens: int = 16384
    decode_step_base_secs: float = 0.01
    decode_step_per_req_secs: float = 0.0002
    decode_step_per_ctx_token_secs: float = 0.0
    kv_bytes_per_token: int = 131072
    kv_transfer_gbps: float = 20.0
    max_total_num_tokens: int = 200000
    max_running_requests: int = 256
    switch_secs: float = 0.2
    bootstrap_timeout_secs: float = 30.0
    room_timeout_secs: float = 30.0

    def validate(self) -> None:
        """Raise ValueError naming the first knob outside its range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")
        for name in ("max_prefill_tokens", "max_total_num_tokens", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_transfer_gbps <= 0:
            raise ValueError("kv_transfer_gbps must be > 0")

    def prefill_secs(self, num_tokens: int) -> float:
        """Modeled duration of one prefill forward over ``num_tokens`` tokens."""
        return self.prefill_batch_overhead_secs + num_tokens * self.prefill_secs_per_token

    def decode_step_secs(self, batch_size: int, context_tokens: int = 0) -> float:
        """Modeled duration of one decode step with ``batch_size`` running requests whose KV
        holds ``context_tokens`` tokens in all: attention reads every one of them each step."""
        return (
            self.decode_step_base_secs
            + batch_size * self.decode_step_per_req_secs
            + context_tokens * self.decode_step_per_ctx_token_secs
        )

    def transfer_secs(self, num_tokens: int) -> float:
        """Modeled duration of moving the KV of ``num_tokens`` tokens from prefill to decode."""
        return num_tokens * self.kv_bytes_per_token / (self.kv_transfer_gbps * 1e9)

    async def wait(self, modeled_secs: float) -> None:
        """Sleep for a modeled duration scaled by ``speed`` (no sleep at all when it is zero)."""
        scaled = modeled_secs * self.speed
        if scaled > 0:
            await asyncio.sleep(scaled)

    def scaled(self, modeled_secs: float) -> float:
        """Wall-clock seconds of a modeled duration."""
        return modeled_secs * self.speed


_H100_8B = TimingModel(
    prefill_secs_per_token=0.00004,
    prefill_batch_overhead_secs=0.007,
    max_prefill_tokens=16384,
    decode_step_base_secs=0.009,
    decode_step_per_req_secs=0.00002,
    decode_step_per_ctx_token_secs=0.00000004,
    kv_bytes_per_token=131072,
    kv_transfer_gbps=25.0,
    max_total_num_tokens=557000,
    max_running_requests=256,
    switch_secs=3.0,
)

PROFILES: MappingProxyType[str, TimingModel] = MappingProxyType({"h100-8b": _H100_8B})
"""Named timing models (``pd-worker serve --profile NAME``); explicit knobs override them."""


def profile(name: str | None, **knobs: Any) -> TimingModel:
    """The timing model of profile ``name`` (the defaults when None) with ``knobs`` applied.

    Raises ValueError for an unknown profile name, listing the known ones."""
    if name is None:
        base = TimingModel()
    elif name in PROFILES:
        base = PROFILES[name]
    else:
        raise ValueError(f"unknown timing profile {name!r}; known: {', '.join(PROFILES)}")
    return replace(base, **knobs)
