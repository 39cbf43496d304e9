"""What one autopilot sample saw: per worker and per pool, taken at one instant.

Worker-side figures come from SGLang's ``GET /v1/loads`` (one ``loads[]`` entry per DP rank,
summed here); router-side figures (in-flight, TTFT, TPOT, 503s for lack of a worker) from the
router's own bookkeeping. The policy only reads these frozen records, so a recorded sequence of
them replays a decision exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pd_protocol.json_values import is_number

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class WorkerSignals:
    """One worker at sample time. ``running``/``waiting``/``token_usage``/``used_tokens``/
    ``queued_prefill_tokens``/``max_running`` are zero when its ``/v1/loads`` could not be
    read (``max_running`` also when the worker does not report it). ``waiting`` is every
    request the worker holds but does not run; ``waiting_for_slot`` only those a decode could
    run now (their KV is in) but for a free batch slot, not those still waiting for their
    prefill.

    The capacity counters only grow (SGLang >= 0.5.23; zero, or no moments, where a worker
    does not report them): ``prefill_tokens``/``prefill_busy_us`` are the uncached prompt
    tokens prefilled and the time its prefill forwards took; ``decode_moments`` the sums over
    its decode steps of (1, batch size b, step time t in us, b*b, b*t, tokens generated), from
    which the step time's growth with the batch is fitted."""

    url: str
    role: str
    inflight: int = 0
    running: int = 0
    waiting: int = 0
    token_usage: float = 0.0
    used_tokens: int = 0
    queued_prefill_tokens: int = 0
    max_running: int = 0
    waiting_for_slot: int = 0
    prefill_tokens: int = 0
    prefill_busy_us: int = 0
    decode_moments: tuple[float, ...] = ()

    @property
    def active_token_usage(self) -> float:
        """KV usage of the requests a decode runs or could run now. A decode reserves KV for
        a request as soon as it arrives, while its prefill may still be queued: that part
        grows with the prefill pool's backlog and would not shrink by adding a decode."""
        held = self.running + self.waiting
        if held <= 0:
            return self.token_usage
        return self.token_usage * min(1.0, (self.running + self.waiting_for_slot) / held)

    @property
    def remaining_work(self) -> tuple[int, int, int]:
        """Sort key of the work a drain must wait for: requests the worker holds (running and
        waiting, or the router's in-flight count if larger), then KV tokens in use."""
        held = max(self.running + self.waiting, self.inflight)
        return (held, self.used_tokens, self.inflight)


@dataclass(frozen=True)
class Sample:
    """Everything the policy sees at time ``at`` (monotonic seconds). Latencies are the p90 of
    the streams observed within the controller's window (None: none): the time until the
    prefill answered, the wait from there to the first token, and the time per output token.
    ``ttft_attained``/``tpot_attained`` are the shares of those streams within the SLOs (None:
    no SLO or no stream). ``no_worker_503s`` counts requests refused for lack of a worker of
    each role since the previous sample; ``converting`` is true while any conversion runs."""

    at: float
    workers: tuple[WorkerSignals, ...]
    prefill_p90_ms: float | None = None
    decode_wait_p90_ms: float | None = None
    tpot_p90_ms: float | None = None
    no_worker_503s: Mapping[str, int] = field(default_factory=dict)
    converting: bool = False
    ttft_attained: float | None = None
    tpot_attained: float | None = None

    @property
    def attained(self) -> float | None:
        """The lower of the two SLO attainments (None: neither is known)."""
        shares = [a for a in (self.ttft_attained, self.tpot_attained) if a is not None]
        return min(shares) if shares else None

    def pool(self, role: str) -> tuple[WorkerSignals, ...]:
        return tuple(w for w in self.workers if w.role == role)

    def to_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "prefill_p90_ms": _round(self.prefill_p90_ms),
            "decode_wait_p90_ms": _round(self.decode_wait_p90_ms),
            "tpot_p90_ms": _round(self.tpot_p90_ms),
            "ttft_attained": self.ttft_attained,
            "tpot_attained": self.tpot_attained,
            "no_worker_503s": dict(self.no_worker_503s),
            "converting": self.converting,
            "workers": [
                {
                    "url": w.url,
                    "role": w.role,
                    "inflight": w.inflight,
                    "running": w.running,
                    "waiting": w.waiting,
                    "token_usage": w.token_usage,
                    "used_tokens": w.used_tokens,
                    "queued_prefill_tokens": w.queued_prefill_tokens,
                    "max_running": w.max_running,
                    "waiting_for_slot": w.waiting_for_slot,
                    "prefill_tokens": w.prefill_tokens,
                    "prefill_busy_us": w.prefill_busy_us,
                    "decode_moments": list(w.decode_moments),
                }
                for w in self.workers
            ],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def worker_from_loads(url: str, role: str, inflight: int, body: Mapping[str, Any]) -> WorkerSignals:
    """A worker's signals from its ``/v1/loads`` body (SGLang 0.5.x: ``loads[]`` per DP rank
    with ``num_running_reqs``, ``num_waiting_reqs``, ``num_used_tokens``,
    ``max_total_num_tokens``, ``num_waiting_uncached_tokens``, ``num_total_tokens``,
    ``max_running_requests``, the scheduler's ``queues.waiting``). Ranks are summed; the usage is
    used over total tokens across ranks. Missing or mistyped fields count as zero.

    A prefill's queued prompt tokens: SGLang counts only its waiting queue in
    ``num_waiting_uncached_tokens``, but a PD prefill holds new requests in its bootstrap queue
    first (until the decode's KV destination arrives), where they are counted only in
    ``num_total_tokens`` (KV in use plus every queued request's tokens). The larger of the two
    readings is the backlog; under load on real SGLang 0.5.23 the bootstrap queue holds nearly
    all of it.

    The capacity counters (``total_prefill_uncached_tokens``, ``total_prefill_busy_us``,
    ``decode_moments``) are summed over ranks like the rest; a rank without moments adds none."""
    ranks = [r for r in body.get("loads", ()) if isinstance(r, Mapping)]
    used = _total(ranks, "num_used_tokens")
    capacity = _total(ranks, "max_total_num_tokens")
    queued = _total(ranks, "num_waiting_uncached_tokens")
    if role == "prefill":
        queued = max(queued, _total(ranks, "num_total_tokens") - used)
    return WorkerSignals(
        url=url,
        role=role,
        inflight=inflight,
        running=_total(ranks, "num_running_reqs"),
        waiting=_total(ranks, "num_waiting_reqs"),
        token_usage=used / capacity if capacity > 0 else 0.0,
        used_tokens=used,
        queued_prefill_tokens=queued,
        max_running=_total(ranks, "max_running_requests"),
        waiting_for_slot=_total(
            (q for r in ranks if isinstance(q := r.get("queues"), Mapping)), "waiting"
        ),
        prefill_tokens=_total(ranks, "total_prefill_uncached_tokens"),
        prefill_busy_us=_total(ranks, "total_prefill_busy_us"),
        decode_moments=_moments(ranks),
    )


MOMENTS = 6


def _moments(ranks: Iterable[Mapping[str, Any]]) -> tuple[float, ...]:
    """The ranks' decode moments summed; empty when no rank reports a well-formed six."""
    total = [0.0] * MOMENTS
    seen = False
    for rank in ranks:
        moments = rank.get("decode_moments")
        if isinstance(moments, list) and len(moments) == MOMENTS and all(map(is_number, moments)):
            total = [a + float(b) for a, b in zip(total, moments, strict=True)]
            seen = True
    return tuple(total) if seen else ()


def _total(ranks: Iterable[Mapping[str, Any]], key: str) -> int:
    total = 0
    for rank in ranks:
        value = rank.get(key)
        if is_number(value):
            total += int(value)
    return total
