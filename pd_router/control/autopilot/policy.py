"""The autopilot's decision policy: pure code over a window of samples.

Where the workers report their capacity counters, a pool's load is the servers its demand needs
over the servers it has (:mod:`pd_router.control.autopilot.capacity`), and a move must cut the
fuller pool's load at the split it leads to; a conversion is not undone within a guard time
while the demand mix holds, and one that made the SLO attainment worse holds its direction back
(docs/autopilot.md, "Capacity"). Without the counters, the thresholds below decide.

By thresholds it decides the way Dynamo's load planner does (docs.nvidia.com/dynamo,
"Planner Guide" and the v0.8 "Load-based Planner"): every adjustment interval it averages each
pool's load over a window and never goes below a minimum number of workers per pool. Each pool
has several measures, and its load is the one furthest over its target:

- prefill: prompt tokens queued per prefill (``prefill_queue_tokens``) and, with a TTFT SLO,
  the p90 time until the prefill answered;
- decode: KV usage of the requests it runs or could run (``decode_kv_usage``), requests
  running or waiting per batch slot (100%: full) and, with SLOs, TPOT p90 and the p90 wait
  from the prefill's answer to the first token.

Splitting TTFT where the prefill answered tells whose queue a slow first token waited in, so
a decode pool short of batch slots is not mistaken for a slow prefill. Utilisation is always
measured because it leads: a queue grows before finished requests show it in their latency.

Dynamo acts by starting and killing workers (minutes of weight loading); here a server changes
role in place, which makes a wrong move cheaper but not free, so the policy is more careful
than a scaler:

- a pool counts as over target only after its smoothed load rose above ``1 + hysteresis`` times
  the target, and stays over until it falls back to the target (a band, so a load sitting at
  the target neither starts nor resets the clock);
- it converts only after that lasted ``sustain_secs`` (a short spike does nothing), and only if
  the other pool could lose a server and stay under ``margin`` times its target: utilisation
  scaled by N/(N-1) (each remaining server takes its share of the lost one's load), latency
  as measured;
- one conversion at a time, then ``cooldown_secs`` of holding counted from its end, and never
  below the minimum pool sizes; when the needy pool is still over target after a conversion,
  the next one needs fresh samples and the cooldown but no new sustain period, so a phase that
  wants two servers moved gets them one after the other, unless its load is falling across
  the window (the backlog of the old split draining: the new one suffices);
- the direction has a cost: a prefill turns into a decode as soon as the decodes pulled its
  last KV, a decode into a prefill only after every running answer ended, so the decode with
  the least remaining work is chosen and its drain is stated in the decision.

Each decision carries its reason in words with the numbers it was made on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pd_router.control.autopilot.capacity import CapacityModel, Needs
from pd_router.control.autopilot.signals import DECODE, PREFILL, ROLES, Sample, WorkerSignals
from pd_router.control.latency import quantile_of

MODES = ("off", "recommend", "auto")
HOLD = "hold"
PREFILL_TO_DECODE = "prefill_to_decode"
DECODE_TO_PREFILL = "decode_to_prefill"
ACTIONS = (HOLD, PREFILL_TO_DECODE, DECODE_TO_PREFILL)
# A pool that made the router refuse requests within the window counts as at least twice over
# its target: above any hysteresis band (< 1), whatever its measured load says.
REFUSED_RATIO = 2.0
# A needy pool that needs this many times its servers may take one from a donor that would
# keep up at its limit (without the margin).
FAR_OVER = 2.0
# The share of the TTFT SLO that the prefills' standing queue may cost on the prefills a move
# keeps.
QUEUE_WAIT_SHARE = 0.5
# A donor's peak need is this quantile of its needs over ``peak_secs``. The highest one is a
# burst's flush: on the Azure trace in the fleet simulator it held servers a split needed and
# let a quiet ten seconds move them (docs/autopilot.md, rule 2).
PEAK_QUANTILE = 0.8


@dataclass(frozen=True)
class AutopilotConfig:
    """The ``[autopilot]`` section. The utilisation thresholds always apply; latency SLOs,
    when set, add targets to their pools."""

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
    flip_guard_secs: float = 600.0
    peak_secs: float = 300.0
    flip_mix_change: float = 0.15
    judge_tolerance: float = 0.1


@dataclass(frozen=True)
class Measure:
    """One smoothed measure of a pool against its target. A utilisation (queued tokens, KV,
    batch slots) ``scales``: spread over one server fewer it grows by N/(N-1). A latency does
    not: a decode step takes about as long with one decode fewer until the slots run out."""

    name: str
    value: float
    target: float
    unit: str
    scales: bool

    @property
    def ratio(self) -> float:
        return self.value / self.target

    def projected(self, size: int) -> float:
        """This measure's value with one server fewer; infinite for a pool of one."""
        if size <= 1:
            return float("inf")
        return self.value * size / (size - 1) if self.scales else self.value

    def fmt(self, value: float) -> str:
        return f"{value:.0f}{self.unit}" if self.unit == "%" else f"{value:.0f} {self.unit}"


@dataclass(frozen=True)
class PoolLoad:
    """One pool's smoothed load: its measures, the one furthest over its target (``measure``)
    and that ratio (1.0 is exactly on target; refusals raise it to ``REFUSED_RATIO``)."""

    role: str
    size: int
    measures: tuple[Measure, ...]
    ratio: float
    refused: int
    over_for: float
    falling: bool = False
    # The servers it needs, from capacity (:mod:`capacity`), and how that was reckoned; None
    # where the workers report no capacity counters (the ratio is then its fullest measure's).
    need: float | None = None
    basis: str | None = None

    @property
    def measure(self) -> Measure:
        return max(self.measures, key=lambda m: m.ratio)

    def projected_ratio(self) -> float:
        """The load ratio with one server fewer, over every measure."""
        return max(m.projected(self.size) / m.target for m in self.measures)

    def describe(self, measure: Measure | None = None) -> str:
        m = measure or self.measure
        return f"{self.role} {m.name} {m.fmt(m.value)}"

    def over_text(self) -> str:
        if self.need is not None:
            text = (
                f"{self.role} needs {self.need:.1f} of its {self.size} ({self.basis}) "
                f"for {self.over_for:.0f} s"
            )
            if self.refused:
                text += f", {self.refused} requests refused for lack of a {self.role}"
            return text
        m = self.measure
        text = f"{self.describe()} > {m.fmt(m.target)} for {self.over_for:.0f} s"
        if self.refused:
            text += f", {self.refused} requests refused for lack of a {self.role}"
        return text

    def donor_text(self) -> str:
        m = max(self.measures, key=lambda m: m.projected(self.size) / m.target)
        return f"{self.describe(m)} would be {m.fmt(m.projected(self.size))} with one fewer"

    def to_json(self) -> dict[str, Any]:
        m = self.measure
        return {
            "role": self.role,
            "size": self.size,
            "measure": m.name,
            "value": round(m.value, 2),
            "target": round(m.target, 2),
            "unit": m.unit.strip(),
            "ratio": round(self.ratio, 3),
            "refused": self.refused,
            "over_for_secs": round(self.over_for, 1),
            "falling": self.falling,
            "need": None if self.need is None else round(self.need, 2),
            "basis": self.basis,
            "measures": [
                {"measure": x.name, "value": round(x.value, 2), "target": round(x.target, 2),
                 "unit": x.unit.strip(), "ratio": round(x.ratio, 3)}
                for x in self.measures
            ],
        }  # fmt: skip


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
    # Every worker the decision converts (the first is ``worker``): several where a large fleet
    # wants several servers moved at once.
    workers: tuple[str, ...] = ()
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
        moved = max(1, len(self.workers))
        shift = {HOLD: 0, PREFILL_TO_DECODE: -moved, DECODE_TO_PREFILL: moved}[self.action]
        return {PREFILL: self.prefill + shift, DECODE: self.decode - shift}

    def to_json(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "action": self.action,
            "reason": self.reason,
            "mode": self.mode,
            "applied": self.applied,
            "worker": self.worker,
            "workers": list(self.workers),
            "from_role": self.from_role,
            "to_role": self.to_role,
            "cost": self.cost,
            "prefill": self.prefill,
            "decode": self.decode,
            "desired": self.desired,
        }


@dataclass
class Move:
    """A conversion the policy decided: its direction, when, the demand mix then (the prefill
    share of the need), the whole need in servers (None: capacity unknown) and the SLO
    attainment before it, judged once the split after it settled. ``further``: the servers it
    wanted moved (its shortfall, up to the balanced split) but could not (``max_moves`` on a
    large fleet, or the donor's margin)."""

    action: str
    at: float
    mix: float
    demand: float | None
    attained_before: float | None
    judged: bool = False
    further: int = 0


class AutopilotPolicy:
    """Feeds on samples (:meth:`step`) and returns one decision per sample."""

    def __init__(
        self, config: AutopilotConfig, min_prefill: int, min_decode: int, max_moves: int = 1
    ) -> None:
        """``max_moves``: the most servers one decision converts (the conversion manager's
        ``max_concurrent``)."""
        self.config = config
        self.minimum = {PREFILL: min_prefill, DECODE: min_decode}
        self.max_moves = max_moves
        self._window: deque[Sample] = deque()
        self._over_since: dict[str, float | None] = dict.fromkeys(ROLES)
        self._last_conversion: float | None = None
        # What the cooldown counts from, as the hold says it: a conversion seen ending, one
        # decided (not seen running yet), or a recommendation, which changed nothing.
        self._last_event = "conversion ended"
        self.loads: dict[str, PoolLoad] = {}
        self.capacity = CapacityModel()
        self.needs: Needs | None = None
        # (time, prefill need, decode need) of the last ``peak_secs``: a donor must carry the
        # peak of its own demand with one server fewer, not only the window's mean.
        self._peaks: deque[tuple[float, float, float]] = deque()
        self._last_move: Move | None = None
        # Directions that made the SLO attainment worse: held until (monotonic), and the next
        # back-off (doubled by each conversion judged worse, reset by one that was not).
        self._blocked: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self.last_judgement: str | None = None

    def reconfigure(self, config: AutopilotConfig) -> None:
        """New targets or mode; the window and the cooldown carry over."""
        self.config = config

    def step(self, sample: Sample) -> Decision:
        if sample.converting:
            # The pools are mid-change: what they show now says nothing about either split, so
            # the sample joins neither the window nor the over-target clocks; the loads shown
            # are this sample's alone. The cooldown runs from the end of the conversion.
            self._last_conversion = sample.at
            self._last_event = "conversion ended"
            self.loads = {
                role: self._pool_load(role, sample, (sample,), clock=False) for role in ROLES
            }
            return self._hold(sample, "a conversion is running")
        self._remember(sample)
        self.needs = self._needs()
        self._remember_peak(sample.at)
        self.loads = {
            role: self._pool_load(role, sample, self._window, clock=True, needs=self.needs)
            for role in ROLES
        }
        return self._decide(sample)

    def _remember_peak(self, now: float) -> None:
        needs = self.needs
        if needs is not None:
            self._peaks.append((now, needs.prefill, needs.decode))
        while self._peaks and self._peaks[0][0] < now - self.config.peak_secs:
            self._peaks.popleft()

    def _peak(self, role: str) -> float:
        """The need ``role`` reached or passed in ``1 - PEAK_QUANTILE`` of the samples of the
        last ``peak_secs`` (0 when none was reckoned): a level its demand keeps coming back
        to, not the single highest sample, which a burst's flush sets."""
        column = 1 if role == PREFILL else 2
        needs = sorted(entry[column] for entry in self._peaks)
        return quantile_of(needs, PEAK_QUANTILE) if needs else 0.0

    def _needs(self) -> Needs | None:
        """Both pools' needs from capacity over the window (None: a speed is unknown)."""
        if len(self._window) < 2:
            return None
        c = self.config
        return self.capacity.needs(
            list(self._window),
            kv_target=c.decode_kv_usage,
            tpot_slo_ms=c.tpot_slo_ms,
        )

    # --- smoothing -----------------------------------------------------------------------

    def _remember(self, sample: Sample) -> None:
        self._window.append(sample)
        horizon = sample.at - self.config.window_secs
        while len(self._window) > 1 and self._window[0].at < horizon:
            self._window.popleft()

    def _pool_load(
        self,
        role: str,
        now: Sample,
        samples: Iterable[Sample],
        *,
        clock: bool,
        needs: Needs | None = None,
    ) -> PoolLoad:
        """The pool's load over ``samples``; with ``clock`` its over-target clock advances
        (not for a sample taken while a conversion runs). With ``needs`` its ratio is its need
        over its size (latencies lag and do not decide); without, its fullest measure's."""
        specs = self._specs(role)
        series = {spec.name: _series(role, spec, samples) for spec in specs}
        measures = tuple(
            Measure(spec.name, _mean(series[spec.name]), spec.target, spec.unit, spec.scales)
            for spec in specs
        )
        refused = sum(s.no_worker_503s.get(role, 0) for s in samples)
        size = len(now.pool(role))
        need = basis = None
        if needs is not None:
            need = needs.prefill if role == PREFILL else needs.decode
            basis = needs.basis[role]
            ratio = need / size if size else float("inf")
        else:
            ratio = max(m.ratio for m in measures)
        if refused:
            ratio = max(ratio, REFUSED_RATIO)
        if clock:
            over_for = self._track_over(role, ratio, now.at)
        else:
            since = self._over_since[role]
            over_for = 0.0 if since is None else now.at - since
        falling = not refused and self._falling(measures, series)
        return PoolLoad(role, size, measures, ratio, refused, over_for, falling, need, basis)

    def _falling(self, measures: tuple[Measure, ...], series: dict[str, list[float]]) -> bool:
        """Whether the pool's fullest queue or cache (its utilisation measure furthest over
        target) fell by more than the hysteresis across the window. Latency percentiles lag:
        they still rise while the backlog behind them drains, so they do not say."""
        utilisation = [m for m in measures if m.scales]
        if not utilisation:
            return False
        values = series[max(utilisation, key=lambda m: m.ratio).name]
        return len(values) >= 2 and values[-1] < values[0] * (1.0 - self.config.hysteresis)

    def _specs(self, role: str) -> list[_Spec]:
        """What each pool is measured by. Utilisation always (it leads: a queue grows before
        the latencies of finished requests show it); latency SLOs when set. TTFT is split at
        the prefill's answer, so a decode that keeps requests waiting for a batch slot is
        blamed for its part instead of the prefill."""
        c = self.config
        if role == PREFILL:
            specs = [_Spec("queued tokens per worker", "tokens", c.prefill_queue_tokens, True,
                           _queued_prefill_tokens)]  # fmt: skip
            if c.ttft_slo_ms is not None:
                specs.append(_Spec("time to prefill p90", "ms", c.ttft_slo_ms, False,
                                   lambda s: s.prefill_p90_ms))  # fmt: skip
            return specs
        specs = [
            _Spec("KV", "%", c.decode_kv_usage * 100, True, _decode_kv_percent),
            _Spec("batch slots in demand", "%", 100.0, True, _decode_slots_percent),
        ]
        if c.tpot_slo_ms is not None:
            specs.append(_Spec("TPOT p90", "ms", c.tpot_slo_ms, False, lambda s: s.tpot_p90_ms))
        if c.ttft_slo_ms is not None:
            specs.append(_Spec("wait after prefill p90", "ms", c.ttft_slo_ms, False,
                               lambda s: s.decode_wait_p90_ms))  # fmt: skip
        return specs

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
        cooling = self._cooldown(sample, None)
        if cooling is not None:
            return self._hold(sample, cooling)
        self._judge(sample)
        if len(self._window) < 2 and self.capacity.prefill_rate is not None:
            # The workers report their capacity: a window too short to measure the demand
            # does not fall back to the thresholds.
            return self._hold(sample, "measuring the demand: one sample since the last change")
        over = [p for p in (prefill, decode) if self._persistently_over(p)]
        absorbing = [p for p in over if self._absorbs(p)]
        over = [p for p in over if p not in absorbing]
        if not over:
            if absorbing:
                return self._hold(sample, self._absorbed_text(absorbing[0]))
            return self._hold(sample, self._steady_text(prefill, decode))
        if len(over) == 2 and self.needs is None:
            return self._hold(
                sample, f"both pools over target ({prefill.over_text()}; {decode.over_text()})"
            )
        needy = max(over, key=lambda pool: pool.ratio)
        donor = decode if needy is prefill else prefill
        if donor.size - 1 < self.minimum[donor.role]:
            return self._hold(
                sample,
                f"{needy.over_text()}; {donor.role} pool at its minimum "
                f"({donor.size}, min {self.minimum[donor.role]})",
            )
        action = PREFILL_TO_DECODE if donor.role == PREFILL else DECODE_TO_PREFILL
        cooling = self._cooldown(sample, action)
        if cooling is not None:
            return self._hold(sample, cooling)
        moves, refusal = self._movable(needy, donor)
        refusal = refusal or self._guard(action, sample)
        if refusal is not None:
            return self._hold(sample, f"{needy.over_text()}; {refusal}")
        return self._convert(sample, needy, donor, moves)

    def _cooldown(self, sample: Sample, action: str | None) -> str | None:
        """Why the cooldown holds a decision now (``action``: the one it would be; None: not
        reckoned yet), or None. A move that stopped short of its target (``max_moves``) lets
        the next step the same way come a window after its conversions ended, the cooldown
        at most: a large fleet whose mix shifted gets its servers in steps at the pace the
        samples confirm the shift, not one step per cooldown."""
        if self._last_conversion is None:
            return None
        c = self.config
        elapsed = sample.at - self._last_conversion
        if elapsed >= c.cooldown_secs:
            return None
        last = self._last_move
        onward = last is not None and last.further > 0 and action in (None, last.action)
        if onward and elapsed >= min(c.window_secs, c.cooldown_secs):
            return None
        return (
            f"cooldown: last {self._last_event} {elapsed:.0f} s ago "
            f"(cooldown {c.cooldown_secs:.0f} s)"
        )

    def _movable(self, needy: PoolLoad, donor: PoolLoad) -> tuple[int, str | None]:
        """How many servers to move from ``donor`` to ``needy`` at once, or 0 and why moving
        one is not worth it.

        From capacity: the split whose fuller pool is least loaded (:meth:`_best_split`) must
        lie the needy pool's way and cut the fuller pool's load by the hysteresis. With the
        servers moved toward it gone, the donor's need (the decodes' fed as the prefills would
        then feed them, :meth:`Needs.decode_at`), or its peak need of the last ``peak_secs`` if
        that was higher (a real trace comes in bursts), must stay under ``1 - hysteresis`` of
        the servers it keeps (all of them for a needy pool ``FAR_OVER`` its own,
        :meth:`_donor_bound`): a move serves both pools with margin or is not made (a fleet
        short everywhere only moves its shortage around, and each move's drain costs it
        more). As many move at once as keep that true, up to the way to the best split and
        ``max_moves``. A prefill donor must also leave the queue standing now to the prefills
        it keeps for no longer than ``QUEUE_WAIT_SHARE`` of the TTFT SLO: its need counts
        the arrivals, not the queue, and a prefill moved while the others still clear a burst
        leaves every request queued behind it late. Without:
        one server, and the donor's utilisation x N/(N-1), latency as measured, must stay
        under ``margin`` of its target."""
        if self.needs is None:
            if donor.projected_ratio() < self.config.margin:
                return 1, None
            margin = self.config.margin
            return 0, f"but {donor.donor_text()}, not under {margin:.0%} of its target"
        prefills, total = self.loads[PREFILL].size, self._fleet()
        target = self._best_split()
        name = f"{target}P{total - target}D"
        if (target > prefills) != (needy.role == PREFILL) or target == prefills:
            return 0, f"but the split that serves both best is {name}"
        now = max(needy.ratio, donor.ratio)
        best = max(self._loads_at(target))
        if best > now * (1.0 - self.config.hysteresis):
            return 0, (
                f"but the best split, {name}, would leave the fuller pool at {best:.0%} of its "
                f"servers, not {self.config.hysteresis:.0%} below {now:.0%} now"
            )
        bound = self._donor_bound(needy)
        sign = 1 if needy.role == PREFILL else -1
        movable, short = 0, ""
        for moves in range(1, min(abs(target - prefills), self.max_moves, self._enough(needy)) + 1):
            kept = donor.size - moves
            at = self._loads_at(prefills + sign * moves)[donor.role == DECODE]
            need = max(at * kept, self._peak(donor.role))
            if need > kept * bound:
                short = (
                    f"{donor.role} would need {need:.1f} of {kept} with one server moved, not "
                    f"under {bound:.0%} of them"
                )
                break
            wait, budget = self._queue_wait(donor.role, kept), self._queue_budget()
            if wait > budget:
                short = (
                    f"the prefills' queue would keep requests waiting {wait:.1f} s on {kept}, "
                    f"over {budget:.1f} s"
                )
                break
            movable = moves
        if movable == 0:
            return 0, f"but {short}"
        return movable, None

    def _queue_wait(self, role: str, kept: int) -> float:
        """Seconds the prompt tokens queued now would take ``kept`` prefills to prefill (what
        the last request queued waits before its forward, arrivals left aside); 0 for
        decodes, whose queue for a slot their need already counts."""
        needs = self.needs
        assert needs is not None
        return needs.queued / (kept * needs.prefill_rate) if role == PREFILL else 0.0

    def _queue_budget(self) -> float:
        """The wait a prefill donor's queue may cost the prefills it keeps: ``QUEUE_WAIT_SHARE``
        of the TTFT SLO (unbounded without one)."""
        slo = self.config.ttft_slo_ms
        return float("inf") if slo is None else QUEUE_WAIT_SHARE * slo / 1000

    def _donor_bound(self, needy: PoolLoad) -> float:
        """The share of the servers it keeps that the donor's need may reach: ``1 -
        hysteresis``, or all of them where the needy pool needs ``FAR_OVER`` times its servers
        or more. A move that halves a pool far over its servers is worth a donor at its limit
        (real processes from 3P1D, the decode at 2470%: held 24 s by the margin alone)."""
        return 1.0 if needy.ratio >= FAR_OVER else 1.0 - self.config.hysteresis

    def _enough(self, needy: PoolLoad) -> int:
        """The servers that bring ``needy`` under ``1 - hysteresis`` of its own, at least one:
        a move follows the measured shortfall rather than going all the way to the balanced
        split, whose far side a burst's window overstates (on the Azure trace at 128-512
        simulated workers: the same goodput with a quarter to a third fewer conversions)."""
        assert needy.need is not None
        wanted = math.ceil(needy.need / (1.0 - self.config.hysteresis) - 1e-9)
        return max(1, wanted - needy.size)

    def _fleet(self) -> int:
        return self.loads[PREFILL].size + self.loads[DECODE].size

    def _loads_at(self, prefills: int) -> tuple[float, float]:
        """The prefill and decode pools' loads (need over size) at a split of ``prefills``."""
        needs = self.needs
        assert needs is not None
        decodes = self._fleet() - prefills
        return needs.prefill / prefills, needs.decode_at(prefills) / decodes

    def _best_split(self) -> int:
        """The number of prefills, within the minimum pools, at which the fuller pool is least
        loaded (the nearest to today's of equals)."""
        now, total = self.loads[PREFILL].size, self._fleet()
        low = max(1, self.minimum[PREFILL])
        high = total - max(1, self.minimum[DECODE])
        splits = range(low, high + 1) if low <= high else range(now, now + 1)
        return min(splits, key=lambda p: (max(self._loads_at(p)), abs(p - now)))

    def _guard(self, action: str, sample: Sample) -> str | None:
        """Why ``action`` is held back by the last conversion, or None: it would undo the last
        one within ``flip_guard_secs`` while the demand mix moved less than
        ``flip_mix_change``, or a conversion this way was judged to have made things worse."""
        c = self.config
        blocked = self._blocked.get(action)
        if blocked is not None and sample.at < blocked:
            return f"backing off: {self.last_judgement} (for {blocked - sample.at:.0f} s more)"
        last = self._last_move
        if last is None or last.action == action:
            return None
        elapsed = sample.at - last.at
        mix = self._mix()
        if elapsed >= c.flip_guard_secs or abs(mix - last.mix) >= c.flip_mix_change:
            return None
        return (
            f"but that would undo the conversion of {elapsed:.0f} s ago: prefill share of the "
            f"demand {last.mix:.0%} then, {mix:.0%} now (undone only after "
            f"{c.flip_guard_secs:.0f} s or a change of {c.flip_mix_change:.0%})"
        )

    def _mix(self) -> float:
        """The prefill share of what both pools need (their load ratio times their size when
        their capacity is unknown)."""
        if self.needs is not None:
            return self.needs.mix()
        prefill, decode = self.loads[PREFILL], self.loads[DECODE]
        total = prefill.ratio * prefill.size + decode.ratio * decode.size
        return prefill.ratio * prefill.size / total if total > 0 else 0.5

    def _demand(self) -> float | None:
        """Both pools' need in servers (None: capacity unknown)."""
        return None if self.needs is None else self.needs.prefill + self.needs.decode

    def _judge(self, sample: Sample) -> None:
        """Once the split after the last conversion settled (a full window after it ended),
        compare the SLO attainment with the one before it; a conversion that made it worse
        by more than ``judge_tolerance`` holds its direction back for ``flip_guard_secs``,
        doubled each time that direction is judged worse again. Where the demand itself
        moved by more than ``judge_tolerance`` meanwhile, the attainment says nothing about
        the conversion: it is not judged."""
        last = self._last_move
        settled = self._last_conversion is not None and (
            sample.at - self._last_conversion >= self.config.window_secs
        )
        if last is None or last.judged or not settled:
            return
        before, after = last.attained_before, sample.attained
        if before is None or after is None:
            return
        last.judged = True
        verb = last.action.replace("_", " ")
        then, now = last.demand, self._demand()
        if then and now is not None and abs(now - then) > self.config.judge_tolerance * then:
            self.last_judgement = (
                f"{verb} not judged: the demand moved from {then:.1f} to {now:.1f} servers"
            )
            return
        if after < before - self.config.judge_tolerance:
            backoff = self._backoff.get(last.action, self.config.flip_guard_secs)
            self._blocked[last.action] = sample.at + backoff
            self._backoff[last.action] = 2 * backoff
            self.last_judgement = f"{verb} made SLO attainment worse: {before:.0%} -> {after:.0%}"
        else:
            self._backoff.pop(last.action, None)
            self.last_judgement = f"{verb} kept SLO attainment: {before:.0%} -> {after:.0%}"

    def _persistently_over(self, pool: PoolLoad) -> bool:
        """Over target for ``sustain_secs`` and not already recovering: a pool whose load
        falls across the window (a backlog draining after a conversion) needs no server."""
        return (
            self._over_since[pool.role] is not None
            and pool.over_for >= self.config.sustain_secs
            and pool.ratio > 1.0
            and not pool.falling
        )

    def _absorbs(self, pool: PoolLoad) -> bool:
        """Whether ``pool`` is decodes over their servers by capacity that still start every
        answer within the TTFT SLO of its prefill's answer: the router's wait after prefill
        p90 within ``ttft_slo_ms`` in every sample of the window. The decodes' need counts the
        requests queued for a batch slot, so a burst the pool drains in time reads as a
        shortage, and a server moved for it leaves the prefills short and comes back (on the
        Azure trace in the fleet simulator: 35 servers converted at 128 workers where 25
        serve as well). A burst not drained in time passes the SLO in that wait and counts."""
        slo = self.config.ttft_slo_ms
        if pool.role != DECODE or pool.need is None or slo is None or pool.refused:
            return False
        waits = [s.decode_wait_p90_ms for s in self._window if s.decode_wait_p90_ms is not None]
        return bool(waits) and max(waits) <= slo

    def _absorbed_text(self, pool: PoolLoad) -> str:
        waits = [s.decode_wait_p90_ms or 0.0 for s in self._window]
        return (
            f"{pool.over_text()}, but absorbs it: wait after prefill p90 at most "
            f"{max(waits):.0f} ms in the window, within the TTFT SLO "
            f"{self.config.ttft_slo_ms:.0f} ms"
        )

    def _convert(self, sample: Sample, needy: PoolLoad, donor: PoolLoad, moves: int) -> Decision:
        chosen = pick_donors(sample.pool(donor.role), donor.role, moves)
        worker, cost = chosen[0]
        self._last_conversion = sample.at
        # Recommendations are spaced as the conversions they stand for would be: one per
        # cooldown, not the same one at every tick.
        recommends = self.config.mode == "recommend"
        self._last_event = "recommendation" if recommends else "conversion decided"
        # Samples of the old split say nothing about the new one. The needy pool's clock keeps
        # running: if it is still over target once the converted server serves, the next step
        # toward it needs no new sustain period, only the cooldown and fresh samples.
        action = PREFILL_TO_DECODE if donor.role == PREFILL else DECODE_TO_PREFILL
        if not recommends:
            further = 0
            if self.needs is not None:
                way = abs(self._best_split() - self.loads[PREFILL].size)
                further = min(way, self._enough(needy)) - moves
            self._last_move = Move(
                action, sample.at, self._mix(), self._demand(), sample.attained, further=further
            )
        effect = donor.donor_text() if self.needs is None else self._after_text(moves)
        self._window.clear()
        self._over_since[donor.role] = None
        return Decision(
            at=sample.at,
            action=action,
            reason=f"{needy.over_text()}; {effect}; convert {worker.url}: {cost}"
            + "".join(f"; and {w.url}: {c}" for w, c in chosen[1:]),
            mode=self.config.mode,
            prefill=len(sample.pool(PREFILL)),
            decode=len(sample.pool(DECODE)),
            worker=worker.url,
            workers=tuple(w.url for w, _ in chosen),
            from_role=donor.role,
            to_role=needy.role,
            cost=cost,
        )

    def _after_text(self, moves: int) -> str:
        target, total = self._best_split(), self._fleet()
        prefill, decode = self._loads_at(target)
        now = self.loads[PREFILL].ratio, self.loads[DECODE].ratio
        return (
            f"at {target}P{total - target}D prefill would be at {prefill:.0%} and decode at "
            f"{decode:.0%} of their servers (now {now[0]:.0%} and {now[1]:.0%}); "
            f"{moves} server{'s' if moves > 1 else ''} toward it"
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
            state = "within"
            if pool.over_for:
                state = "over, falling," if pool.falling else "over"
            m = pool.measure
            parts.append(f"{pool.describe()} ({state} target {m.fmt(m.target)})")
        return "; ".join(parts)


@dataclass(frozen=True)
class _Spec:
    """How to read one measure from a sample (None: nothing to read this time)."""

    name: str
    unit: str
    target: float
    scales: bool
    read: Callable[[Sample], float | None]


def _series(role: str, spec: _Spec, samples: Iterable[Sample]) -> list[float]:
    """The measure's values over ``samples``, oldest first."""
    return [v for v in (spec.read(s) for s in samples if s.pool(role)) if v is not None]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _queued_prefill_tokens(sample: Sample) -> float | None:
    pool = sample.pool(PREFILL)
    return sum(w.queued_prefill_tokens for w in pool) / len(pool) if pool else None


def _decode_kv_percent(sample: Sample) -> float | None:
    pool = sample.pool(DECODE)
    return 100 * sum(w.active_token_usage for w in pool) / len(pool) if pool else None


def _decode_slots_percent(sample: Sample) -> float | None:
    """Requests running or waiting for a batch slot per slot of the pool (over 100%: a queue),
    from the workers that report their ``max_running_requests``. Requests still waiting for
    their prefill's KV are the prefill pool's load, not this one's."""
    pool = [w for w in sample.pool(DECODE) if w.max_running > 0]
    if not pool:
        return None
    demand = sum(w.running + w.waiting_for_slot for w in pool)
    return 100 * demand / sum(w.max_running for w in pool)


def pick_donors(
    pool: tuple[WorkerSignals, ...], role: str, count: int
) -> list[tuple[WorkerSignals, str]]:
    """The ``count`` workers of ``pool`` cheapest to take out (:func:`pick_donor`), cheapest
    first, each with what its drain waits for."""
    chosen: list[tuple[WorkerSignals, str]] = []
    left = list(pool)
    for _ in range(count):
        worker, cost = pick_donor(tuple(left), role)
        chosen.append((worker, cost))
        left.remove(worker)
    return chosen


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
