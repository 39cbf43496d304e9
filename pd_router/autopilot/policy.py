"""The autopilot's decision policy: pure code over a window of samples.

It decides the way Dynamo's load planner does (docs.nvidia.com/dynamo, "Planner Guide" and the
v0.8 "Load-based Planner"): every adjustment interval it averages each pool's load over the
interval, compares prefill against a TTFT target or a queued-prefill-tokens-per-worker
threshold and decode against a TPOT (ITL) target or a KV-usage threshold, and never goes below
a minimum number of workers per pool. Dynamo acts by starting and killing workers (minutes of
weight loading); here a server changes role in place, which makes a wrong move cheaper but not
free, so the policy is more careful than a scaler:

- a pool counts as over target only after its smoothed load rose above ``1 + hysteresis`` times
  the target, and stays over until it falls back to the target (a band, so a load sitting at
  the target neither starts nor resets the clock);
- it converts only after that lasted ``sustain_secs`` (a short spike does nothing), and only if
  the other pool could lose a server and stay under ``margin`` times its target, its load
  scaled by N/(N-1) (each remaining server takes its share of the lost one's load);
- one conversion at a time, then ``cooldown_secs`` of holding, and never below the minimum
  pool sizes;
- the direction has a cost: a prefill turns into a decode as soon as the decodes pulled its
  last KV, a decode into a prefill only after every running answer ended, so the decode with
  the least remaining work is chosen and its drain is stated in the decision.

Each decision carries its reason in words with the numbers it was made on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from pd_router.autopilot.signals import DECODE, PREFILL, ROLES, Sample, WorkerSignals

MODES = ("off", "recommend", "auto")
HOLD = "hold"
PREFILL_TO_DECODE = "prefill_to_decode"
DECODE_TO_PREFILL = "decode_to_prefill"
# A pool that made the router refuse requests within the window counts as at least twice over
# its target: above any hysteresis band (< 1), whatever its measured load says.
REFUSED_RATIO = 2.0


@dataclass(frozen=True)
class AutopilotConfig:
    """The ``[autopilot]`` section. Latency SLOs, when set, are the target of their pool;
    without them the pool's utilisation threshold is."""

    mode: str = "off"
    interval_secs: float = 5.0
    window_secs: float = 30.0
    sustain_secs: float = 30.0
    cooldown_secs: float = 120.0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    prefill_queue_tokens: float = 8192.0
    decode_kv_usage: float = 0.85
    margin: float = 0.8
    hysteresis: float = 0.1
    history: int = 50


@dataclass(frozen=True)
class PoolLoad:
    """One pool's smoothed load against its target; ``ratio`` 1.0 is exactly on target."""

    role: str
    size: int
    measure: str
    value: float
    target: float
    unit: str
    ratio: float
    refused: int
    over_for: float

    def projected_ratio(self) -> float:
        """The load ratio with one server fewer (N/(N-1)); infinite for a pool of one."""
        return self.ratio * self.size / (self.size - 1) if self.size > 1 else float("inf")

    def describe(self) -> str:
        return f"{self.role} {self.measure} {self.fmt(self.value)}"

    def fmt(self, value: float) -> str:
        return f"{value:.0f}{self.unit}" if self.unit == "%" else f"{value:.0f} {self.unit}"

    def over_text(self) -> str:
        text = f"{self.describe()} > {self.fmt(self.target)} for {self.over_for:.0f} s"
        if self.refused:
            text += f", {self.refused} requests refused for lack of a {self.role}"
        return text

    def donor_text(self) -> str:
        projected = self.value * self.size / (self.size - 1)
        return f"{self.describe()} would be {self.fmt(projected)} with one fewer"

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "size": self.size,
            "measure": self.measure,
            "value": round(self.value, 2),
            "target": round(self.target, 2),
            "unit": self.unit.strip(),
            "ratio": round(self.ratio, 3),
            "refused": self.refused,
            "over_for_secs": round(self.over_for, 1),
        }


@dataclass(frozen=True)
class Decision:
    """What the policy decided at ``at``. ``applied`` is true when the mode lets the
    controller act on it (``auto`` and a conversion)."""

    at: float
    action: str
    reason: str
    mode: str
    prefill: int
    decode: int
    worker: str | None = None
    from_role: str | None = None
    to_role: str | None = None
    cost: str | None = None

    @property
    def converts(self) -> bool:
        return self.action != HOLD

    @property
    def applied(self) -> bool:
        return self.converts and self.mode == "auto"

    @property
    def desired(self) -> dict[str, int]:
        """The split this decision aims for."""
        shift = {HOLD: 0, PREFILL_TO_DECODE: -1, DECODE_TO_PREFILL: 1}[self.action]
        return {PREFILL: self.prefill + shift, DECODE: self.decode - shift}

    def to_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "action": self.action,
            "reason": self.reason,
            "mode": self.mode,
            "applied": self.applied,
            "worker": self.worker,
            "from_role": self.from_role,
            "to_role": self.to_role,
            "cost": self.cost,
            "prefill": self.prefill,
            "decode": self.decode,
            "desired": self.desired,
        }


class AutopilotPolicy:
    """Feeds on samples (:meth:`step`) and returns one decision per sample."""

    def __init__(self, config: AutopilotConfig, min_prefill: int, min_decode: int) -> None:
        self.config = config
        self.minimum = {PREFILL: min_prefill, DECODE: min_decode}
        self._window: deque[Sample] = deque()
        self._over_since: dict[str, float | None] = dict.fromkeys(ROLES)
        self._last_conversion: float | None = None
        self.loads: dict[str, PoolLoad] = {}

    def reconfigure(self, config: AutopilotConfig) -> None:
        """New targets or mode; the window and the cooldown carry over."""
        self.config = config

    def step(self, sample: Sample) -> Decision:
        self._remember(sample)
        self.loads = {role: self._pool_load(role, sample) for role in ROLES}
        return self._decide(sample)

    # --- smoothing -----------------------------------------------------------------------

    def _remember(self, sample: Sample) -> None:
        self._window.append(sample)
        horizon = sample.at - self.config.window_secs
        while len(self._window) > 1 and self._window[0].at < horizon:
            self._window.popleft()

    def _pool_load(self, role: str, now: Sample) -> PoolLoad:
        measure, unit, target = self._target(role)
        values = [v for v in (self._measure(role, s) for s in self._window) if v is not None]
        value = sum(values) / len(values) if values else 0.0
        refused = sum(s.no_worker_503s.get(role, 0) for s in self._window)
        ratio = value / target
        if refused:
            ratio = max(ratio, REFUSED_RATIO)
        over_for = self._track_over(role, ratio, now.at)
        return PoolLoad(
            role, len(now.pool(role)), measure, value, target, unit, ratio, refused, over_for
        )

    def _target(self, role: str) -> tuple[str, str, float]:
        c = self.config
        if role == PREFILL:
            if c.ttft_slo_ms is not None:
                return "TTFT p90", "ms", c.ttft_slo_ms
            return "queued prefill tokens per worker", "tokens", c.prefill_queue_tokens
        if c.tpot_slo_ms is not None:
            return "TPOT p90", "ms", c.tpot_slo_ms
        return "KV", "%", c.decode_kv_usage * 100

    def _measure(self, role: str, sample: Sample) -> float | None:
        c = self.config
        if role == PREFILL and c.ttft_slo_ms is not None:
            return sample.ttft_p90_ms
        if role == DECODE and c.tpot_slo_ms is not None:
            return sample.tpot_p90_ms
        pool = sample.pool(role)
        if not pool:
            return None
        if role == PREFILL:
            return sum(w.queued_prefill_tokens for w in pool) / len(pool)
        return 100 * sum(w.token_usage for w in pool) / len(pool)

    def _track_over(self, role: str, ratio: float, now: float) -> float:
        """Seconds the pool has been over target: the clock starts above the band and stops
        only when the load is back at the target."""
        since = self._over_since[role]
        if since is None and ratio > 1.0 + self.config.hysteresis:
            self._over_since[role] = since = now
        elif since is not None and ratio <= 1.0:
            self._over_since[role] = since = None
        return 0.0 if since is None else now - since

    # --- deciding ------------------------------------------------------------------------

    def _decide(self, sample: Sample) -> Decision:
        prefill, decode = self.loads[PREFILL], self.loads[DECODE]
        if sample.converting:
            return self._hold(sample, "a conversion is running")
        if self._last_conversion is not None:
            elapsed = sample.at - self._last_conversion
            if elapsed < self.config.cooldown_secs:
                return self._hold(
                    sample,
                    f"cooldown: last conversion {elapsed:.0f} s ago "
                    f"(cooldown {self.config.cooldown_secs:.0f} s)",
                )
        over = [p for p in (prefill, decode) if self._persistently_over(p)]
        if not over:
            return self._hold(sample, self._steady_text(prefill, decode))
        if len(over) == 2:
            return self._hold(
                sample, f"both pools over target ({prefill.over_text()}; {decode.over_text()})"
            )
        needy = over[0]
        donor = decode if needy is prefill else prefill
        if donor.size - 1 < self.minimum[donor.role]:
            return self._hold(
                sample,
                f"{needy.over_text()}; {donor.role} pool at its minimum "
                f"({donor.size}, min {self.minimum[donor.role]})",
            )
        if donor.projected_ratio() >= self.config.margin:
            return self._hold(
                sample,
                f"{needy.over_text()}; but {donor.donor_text()}, not under "
                f"{self.config.margin:.0%} of its target",
            )
        return self._convert(sample, needy, donor)

    def _persistently_over(self, pool: PoolLoad) -> bool:
        return (
            self._over_since[pool.role] is not None
            and pool.over_for >= self.config.sustain_secs
            and pool.ratio > 1.0
        )

    def _convert(self, sample: Sample, needy: PoolLoad, donor: PoolLoad) -> Decision:
        worker, cost = pick_donor(sample.pool(donor.role), donor.role)
        self._last_conversion = sample.at
        self._window.clear()
        self._over_since = dict.fromkeys(ROLES)
        action = PREFILL_TO_DECODE if donor.role == PREFILL else DECODE_TO_PREFILL
        return Decision(
            at=sample.at,
            action=action,
            reason=f"{needy.over_text()}; {donor.donor_text()}; convert {worker.url}: {cost}",
            mode=self.config.mode,
            prefill=len(sample.pool(PREFILL)),
            decode=len(sample.pool(DECODE)),
            worker=worker.url,
            from_role=donor.role,
            to_role=needy.role,
            cost=cost,
        )

    def _hold(self, sample: Sample, reason: str) -> Decision:
        return Decision(
            at=sample.at,
            action=HOLD,
            reason=reason,
            mode=self.config.mode,
            prefill=len(sample.pool(PREFILL)),
            decode=len(sample.pool(DECODE)),
        )

    @staticmethod
    def _steady_text(prefill: PoolLoad, decode: PoolLoad) -> str:
        parts = []
        for pool in (prefill, decode):
            state = "over" if pool.over_for else "within"
            parts.append(f"{pool.describe()} ({state} target {pool.fmt(pool.target)})")
        return "; ".join(parts)


def pick_donor(pool: tuple[WorkerSignals, ...], role: str) -> tuple[WorkerSignals, str]:
    """The worker of ``pool`` that is cheapest to take out, and what its drain waits for.

    A prefill is free once the decodes pulled the KV of its in-flight requests, so the one
    with the fewest in flight (then the shortest queue) goes. A decode must finish every
    running answer first, so the one with the least remaining work goes.
    """
    if role == PREFILL:
        worker = min(pool, key=lambda w: (w.inflight, w.queued_prefill_tokens, w.url))
        return worker, (
            f"prefill with the fewest in flight ({worker.inflight}); free once their KV is pulled"
        )
    worker = min(pool, key=lambda w: (w.remaining_work, w.url))
    held = worker.remaining_work[0]
    return worker, (
        f"decode with the least remaining work: waits for {held} running answers "
        f"({worker.used_tokens} KV tokens)"
    )
