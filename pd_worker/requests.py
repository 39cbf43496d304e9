"""The worker's view of one generation item and of its progress (framework-free)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

FAKE_BOOTSTRAP_HOST = "2.2.2.2"
ABORT_MESSAGE = "Abort request by AbortReq."


@dataclass(frozen=True)
class GenItem:
    """One sequence to generate: what SGLang's GenerateReqInput holds for a single index."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    @property
    def fake_transfer(self) -> bool:
        """SGLang's health-check convention: this host means "no real KV transfer"."""
        return self.bootstrap_host == FAKE_BOOTSTRAP_HOST or self.bootstrap_room is None


@dataclass
class Progress:
    """Cumulative state of an item after a step: ids so far, text, and finish reason once done."""

    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    kv_source: str | None = None
    cached_tokens: int = 0
    input_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs: list[list[Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Req:
    """Bookkeeping of one in-flight item: its stage (for loads and idleness) and producer task."""

    rid: str
    stage: str | None = None
    task: asyncio.Task[None] | None = None
    abort_message: str = ABORT_MESSAGE


def token_logprob(token_id: int) -> float:
    """A deterministic stand-in for a token's log-probability."""
    return -((token_id % 97) + 1) / 100.0
