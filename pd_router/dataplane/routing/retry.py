"""Retries of a request on a new pair: how many attempts, and the pause before each.

The pause grows geometrically (``backoff_base_secs * backoff_multiplier ** (retry - 1)``), is
capped at ``backoff_max_secs`` and then spread by ``jitter_factor`` (uniformly within plus or
minus that fraction of it), as sglang-router's and smg's ``--retry-*`` flags define it: jitter
keeps the clients of one failed worker from coming back in step. ``enabled = false`` makes every
request one attempt.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 3
    backoff_base_secs: float = 0.02
    backoff_max_secs: float = 0.5
    enabled: bool = True
    backoff_multiplier: float = 2.0
    jitter_factor: float = 0.0


def attempts(config: RetryConfig) -> int:
    """Attempts a request gets before its error goes to the client."""
    return config.max_attempts if config.enabled else 1


def backoff_secs(
    config: RetryConfig, retry: int, draw: Callable[[], float] = random.random
) -> float:
    """The pause before retry number ``retry`` (1 for the first); ``draw`` gives a uniform
    number in [0, 1) for the jitter."""
    delay = min(
        config.backoff_max_secs,
        config.backoff_base_secs * config.backoff_multiplier ** (retry - 1),
    )
    if config.jitter_factor:
        delay *= 1 + config.jitter_factor * (2 * draw() - 1)
    return max(0.0, delay)
