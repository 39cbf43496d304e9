"""What each pool needs, in servers, estimated from the workers' capacity and the traffic's
demand rather than from the last symptom.

A pool's *need* is the number of its servers that would carry the demand at target:

- prefill: the prompt tokens arriving per second (those prefilled in the window plus the
  queue's growth) over what one prefill prefills per second of forward time. A queue standing
  is a symptom, not a demand: it is shown, and it drains wherever the arrivals fit; a burst's
  queue does not move a server (on a compressed Azure trace it moved one at a time the move
  cost more than the burst). A closed-loop load (a fixed number of clients) never asks more
  than the pools serve, so it moves nothing either;
- decode: the requests that want a batch slot (running, or waiting with their KV in) over the
  batch one decode runs within the TPOT SLO, and the KV they hold over ``decode_kv_usage``.

The speeds come from the workers' own counters (SGLang >= 0.5.23 ``/v1/loads``: prefill tokens
and busy time, decode step moments): a prefill's tokens per busy second, a decode's step time
fitted as ``a + b x batch``. A worker's speed belongs to the worker and the model, not to the
traffic, so the last estimate is kept through windows with too little work to measure one.
Without counters a pool's need is its measured load ratio times its size: the servers that
would bring its fullest measure back to target (:class:`pd_router.control.autopilot.policy`).

Moving a decode to the prefills also sends the decodes more requests at once when the prefills
have a backlog: the decodes' need at a split follows the rate the prefills there would feed
them (:meth:`Needs.decode_at`), so a prefill queue cannot talk the pools into starving the
decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pd_router.control.autopilot.signals import (
    DECODE,
    MOMENTS,
    PREFILL,
    Sample,
    WorkerSignals,
)

# Less forward time than this in a window measures no prefill speed (a few forwards' noise).
MIN_BUSY_SECS = 0.05
# Fewer decode steps than this measure no step time; a batch size that hardly varied
# (standard deviation below this) measures no growth with the batch.
MIN_STEPS = 20.0
MIN_BATCH_SPREAD = 0.5


@dataclass(frozen=True)
class StepTime:
    """A decode step's duration in microseconds: ``base + per_request x batch``."""

    base_us: float
    per_request_us: float

    def batch_within(self, tpot_ms: float) -> float:
        """The largest batch whose step stays within ``tpot_ms`` (inf when it never grows)."""
        if self.per_request_us <= 0:
            return float("inf")
        return max(1.0, (tpot_ms * 1000.0 - self.base_us) / self.per_request_us)


@dataclass(frozen=True)
class Needs:
    """What the window showed, and the servers each pool needs from it.

    ``arriving`` and ``prefilled`` are prompt tokens per second (arriving: prefilled plus the
    queue's growth), ``queued`` the prompt tokens queued at the end, ``prefill_rate`` what one
    prefill prefills per second; ``decode`` the decodes' need with requests reaching them as
    fast as they did (``prefilled``), ``prefills`` the prefills there were. ``basis`` says how
    each was reckoned, with the numbers."""

    prefill_rate: float
    arriving: float
    prefilled: float
    queued: float
    decode: float
    prefills: int
    basis: dict[str, str]

    @property
    def prefill(self) -> float:
        """The prefills' need: the arriving prompt tokens over one prefill's speed."""
        return self.arriving / self.prefill_rate

    @property
    def prefills_short(self) -> bool:
        """Whether the prefills there were cannot keep up with the arriving prompt tokens."""
        return self.arriving > self.prefills * self.prefill_rate

    def decode_at(self, prefills: int) -> float:
        """The decodes' need once ``prefills`` prefill: their load follows the prompt tokens
        the prefills pass on (as many more requests held, by Little's law). Prefills short of
        the arrivals pass on what they can of them; prefills that keep up but have a queue
        standing run flat out until it cleared, and send the decodes its requests at once."""
        rate = self.prefill_rate
        flow = min(prefills * rate, self.arriving)
        if self.queued > 0 and not self.prefills_short:
            flow = prefills * rate
        return self.decode * self._scale(flow)

    def mix(self) -> float:
        """The prefill share of what the traffic asks of both pools (0..1), with every arriving
        token prefilled."""
        prefill = self.prefill
        decode = self.decode * self._scale(self.arriving)
        return prefill / (prefill + decode) if prefill + decode > 0 else 0.5

    def _scale(self, flow: float) -> float:
        """The decodes' load at a prompt-token ``flow`` against the one they were fed."""
        fed = self.prefilled if self.prefilled > 0 else min(self.arriving, self.prefill_rate)
        return flow / fed if fed > 0 else 1.0


class CapacityModel:
    """The speeds learnt so far and the needs of a window of samples."""

    def __init__(self) -> None:
        self.prefill_rate: float | None = None  # tokens per busy second, one prefill
        self.step: StepTime | None = None

    def needs(
        self,
        window: Sequence[Sample],
        *,
        kv_target: float,
        tpot_slo_ms: float | None,
    ) -> Needs | None:
        """The needs over ``window`` (oldest first), or None while a speed is unknown."""
        first, last = window[0], window[-1]
        self._learn(first, last)
        rate = self.prefill_rate
        elapsed = last.at - first.at
        batch = _batch(last.pool(DECODE), self.step, tpot_slo_ms)
        if rate is None or batch is None or elapsed <= 0:
            return None
        tokens, _ = _prefill_delta(first, last)
        queued = sum(w.queued_prefill_tokens for w in last.pool(PREFILL))
        queued_before = sum(w.queued_prefill_tokens for w in first.pool(PREFILL))
        arriving = max(0.0, (tokens + queued - queued_before) / elapsed)
        slots = _mean([_slot_demand(s) for s in window])
        kv = _mean([sum(w.active_token_usage for w in s.pool(DECODE)) for s in window])
        basis = {
            PREFILL: (
                f"{arriving:.0f} prompt tokens/s arriving, {queued} queued; a prefill "
                f"prefills {rate:.0f} tokens/s"
            ),
            DECODE: (
                f"{slots:.0f} requests want a batch slot, a decode runs {batch:.0f} "
                f"within target; KV {100 * kv:.0f}% of one decode"
            ),
        }
        return Needs(
            prefill_rate=rate,
            arriving=arriving,
            prefilled=tokens / elapsed,
            queued=queued,
            decode=max(slots / batch, kv / kv_target),
            prefills=len(last.pool(PREFILL)),
            basis=basis,
        )

    def _learn(self, first: Sample, last: Sample) -> None:
        tokens, busy_secs = _prefill_delta(first, last)
        if busy_secs >= MIN_BUSY_SECS and tokens > 0:
            self.prefill_rate = tokens / busy_secs
        step = _fit_step(first, last)
        if step is not None:
            self.step = step


def _same_role(first: Sample, last: Sample, role: str) -> list[tuple[WorkerSignals, WorkerSignals]]:
    """The workers of ``role`` in both samples, as (then, now)."""
    before = {w.url: w for w in first.pool(role)}
    return [(before[w.url], w) for w in last.pool(role) if w.url in before]


def _prefill_delta(first: Sample, last: Sample) -> tuple[int, float]:
    """Prompt tokens prefilled and seconds of forward time between the two samples."""
    pairs = _same_role(first, last, PREFILL)
    tokens = sum(max(0, now.prefill_tokens - then.prefill_tokens) for then, now in pairs)
    busy = sum(max(0, now.prefill_busy_us - then.prefill_busy_us) for then, now in pairs)
    return tokens, busy / 1e6


def _fit_step(first: Sample, last: Sample) -> StepTime | None:
    """The decode step time fitted over the steps between the two samples (least squares
    on the moments' differences), or None when they are too few or too alike."""
    sums = [0.0] * MOMENTS
    for then, now in _same_role(first, last, DECODE):
        if now.decode_moments:
            old = then.decode_moments or (0.0,) * MOMENTS
            steps = zip(sums, old, now.decode_moments, strict=True)
            sums = [total + max(0.0, b - a) for total, a, b in steps]
    n, sb, st, sbb, sbt, _ = sums
    if n < MIN_STEPS:
        return None
    spread = n * sbb - sb * sb
    if spread < (MIN_BATCH_SPREAD * n) ** 2:
        return None
    slope = max(0.0, (n * sbt - sb * st) / spread)
    base = (st - slope * sb) / n
    return StepTime(base, slope) if base > 0 else None


def _batch(
    decodes: Sequence[WorkerSignals], step: StepTime | None, tpot_slo_ms: float | None
) -> float | None:
    """The requests one decode runs at target: its max running requests, fewer when the step
    time would pass the TPOT SLO first (None: the decodes report no batch cap)."""
    caps = [w.max_running for w in decodes if w.max_running > 0]
    if not caps:
        return None
    batch = sum(caps) / len(caps)
    if step is not None and tpot_slo_ms is not None:
        batch = min(batch, step.batch_within(tpot_slo_ms))
    return batch


def _slot_demand(sample: Sample) -> float:
    return sum(w.running + w.waiting_for_slot for w in sample.pool(DECODE))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
