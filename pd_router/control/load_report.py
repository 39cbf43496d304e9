"""What a worker reports about its own load, as SGLang's ``GET /v1/loads`` says it.

SGLang (0.5.23) answers ``{"timestamp", "version", "accelerator", "num_accelerators",
"loads": [...]}``, one ``loads`` entry per DP rank (``dp_rank``, ``num_running_reqs``,
``num_waiting_reqs``, ``num_used_tokens``, ``max_total_num_tokens``, ``token_usage``, ...;
``?include=core`` leaves out the memory, speculative, LoRA, disaggregation and queue sections).
Its waiting count includes the PD queues: a prefill's bootstrap queue, a decode's prealloc,
transfer and retracted queues. pd_worker answers the same shape.

A :class:`LoadReport` is the sum over the ranks; the registry keeps the last one of each worker
(:meth:`pd_router.control.workers.WorkerRegistry.set_load_report`), whoever read it: the poller
(:mod:`pd_router.control.load_poller`) today, an engine's push feed (sglang #32925) as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class BadLoadReport(Exception):
    """An answer of ``/v1/loads`` that is not SGLang's shape."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One worker's load by its own account, summed over its DP ranks. ``token_usage`` is the
    fullest rank's share of its KV pool (that rank admits the fewest new requests);
    ``read_at`` is when the control process read it (monotonic), which tells one report from
    the next."""

    running: int
    waiting: int
    token_usage: float
    ranks: int
    read_at: float

    @property
    def requests(self) -> int:
        """Requests on the worker: running and waiting."""
        return self.running + self.waiting

    def as_dict(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "waiting": self.waiting,
            "token_usage": self.token_usage,
            "ranks": self.ranks,
        }


def parse_loads(body: Any, read_at: float) -> LoadReport:
    """The report in a ``/v1/loads`` answer ``body`` (parsed JSON), read at ``read_at``;
    BadLoadReport if it is not SGLang's shape (no ranks, or a count that is not a number)."""
    ranks = body.get("loads") if isinstance(body, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise BadLoadReport("no 'loads' list of DP ranks")
    running = waiting = 0
    usage = 0.0
    for rank in ranks:
        if not isinstance(rank, dict):
            raise BadLoadReport(f"a DP rank that is not an object: {rank!r}")
        running += _count(rank, "num_running_reqs")
        waiting += _count(rank, "num_waiting_reqs")
        rank_usage = rank.get("token_usage", 0.0)
        if type(rank_usage) not in (int, float):
            raise BadLoadReport(f"token_usage {rank_usage!r} is not a number")
        usage = max(usage, float(rank_usage))
    return LoadReport(running, waiting, usage, len(ranks), read_at)


def _count(rank: dict[str, Any], key: str) -> int:
    value = rank.get(key)
    if type(value) is not int or value < 0:
        raise BadLoadReport(f"{key} {value!r} is not a count")
    return value
