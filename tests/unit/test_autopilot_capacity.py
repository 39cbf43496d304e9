"""The autopilot deciding from capacity (pd_router/control/autopilot/capacity.py and the policy's
capacity rules): the workers' own counters give each pool's speed, the traffic's demand gives
the servers each pool needs, and a conversion must bring the fuller pool's load down. Samples
come from :class:`Pools`, a steady-state model of a fleet under a fixed mix (no processes, no
clock)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pd_router.control.autopilot.capacity import CapacityModel, StepTime
from pd_router.control.autopilot.policy import (
    DECODE_TO_PREFILL,
    HOLD,
    PREFILL_TO_DECODE,
    AutopilotConfig,
    AutopilotPolicy,
    Decision,
)
from pd_router.control.autopilot.signals import Sample, WorkerSignals

CONFIG = AutopilotConfig(
    mode="auto",
    interval_secs=5.0,
    window_secs=20.0,
    sustain_secs=10.0,
    cooldown_secs=20.0,
    ttft_slo_ms=2000.0,
    tpot_slo_ms=30.0,
    hysteresis=0.1,
    flip_guard_secs=300.0,
    peak_secs=30.0,
)
STEP = 5.0
STEP_TIME = StepTime(9000.0, 20.0)


@dataclass
class Pools:
    """A fleet of ``size`` workers, the first ``prefills`` of them prefills, under a steady mix:
    ``prompt_rate`` prompt tokens arriving per second, in requests of ``prompt_tokens``, and
    ``wanting`` requests wanting a decode slot while the prefills keep up (in proportion to
    what they prefill otherwise). A prefill prefills ``prefill_speed`` tokens per second of
    forward time; a decode runs up to ``batch`` requests, its step taking ``step.base_us +
    step.per_request_us x batch``. Every call of :meth:`sample` advances ``STEP`` seconds and
    reads the workers as a router would (cumulative counters, queues)."""

    prompt_rate: float
    wanting: float
    prefills: int = 2
    size: int = 4
    prefill_speed: float = 10_000.0
    prompt_tokens: int = 1000
    batch: int = 32
    step: StepTime = STEP_TIME
    queued: float = 0.0
    at: float = 0.0
    counters: dict[str, list[float]] = field(default_factory=dict)
    attained: float | None = None
    # The router's wait after prefill p90 (None: no stream seen).
    decode_wait_ms: float | None = None

    def sample(self) -> Sample:
        self.at += STEP
        capacity = self.prefills * self.prefill_speed * STEP
        arriving = self.prompt_rate * STEP
        served = min(arriving + self.queued, capacity)
        self.queued += arriving - served
        workers = [self._prefill(f"http://w{i}", served) for i in range(self.prefills)]
        decodes = self.size - self.prefills
        wanting = self.wanting * served / arriving
        workers += [
            self._decode(f"http://w{i}", wanting / decodes) for i in range(self.prefills, self.size)
        ]
        return Sample(
            at=self.at, workers=tuple(workers), ttft_attained=self.attained,
            tpot_attained=self.attained, decode_wait_p90_ms=self.decode_wait_ms,
        )  # fmt: skip

    def _prefill(self, url: str, served: float) -> WorkerSignals:
        tokens, busy, *_ = self.counters.setdefault(url, [0.0] * 8)
        share = served / self.prefills
        self.counters[url][0] = tokens + share
        self.counters[url][1] = busy + share / self.prefill_speed * 1e6
        return WorkerSignals(
            url, "prefill", queued_prefill_tokens=int(self.queued / self.prefills),
            waiting=int(self.queued / self.prompt_tokens / self.prefills),
            prefill_tokens=int(self.counters[url][0]), prefill_busy_us=int(self.counters[url][1]),
        )  # fmt: skip

    def _decode(self, url: str, wanting: float) -> WorkerSignals:
        moments = self.counters.setdefault(url, [0.0] * 8)[2:]
        running = min(self.batch, wanting)
        # Half the steps one request short, half one over: a spread the step time is fitted on.
        for batch in (max(1.0, running - 1), running + 1):
            t = self.step.base_us + self.step.per_request_us * batch
            n = STEP * 1e6 / t / 2
            for i, value in enumerate((n, n * batch, n * t, n * batch * batch, n * batch * t)):
                moments[i] += value
            moments[5] += n * batch
        self.counters[url][2:] = moments
        waiting = max(0.0, wanting - running)
        return WorkerSignals(
            url, "decode", running=round(running), waiting=round(waiting),
            waiting_for_slot=round(waiting), max_running=self.batch,
            token_usage=0.2 * running / self.batch,
            decode_moments=tuple(moments),
        )  # fmt: skip

    def apply(self, decision: Decision) -> None:
        self.prefills = decision.desired["prefill"]


def run(policy: AutopilotPolicy, pools: Pools, steps: int) -> list[Decision]:
    """``steps`` samples, each conversion applied to the pools the next sample shows."""
    decisions = []
    for _ in range(steps):
        decision = policy.step(pools.sample())
        decisions.append(decision)
        pools.apply(decision)
    return decisions


def conversions(decisions: list[Decision]) -> list[str]:
    return [d.action for d in decisions if d.action != HOLD]


def policy(config: AutopilotConfig = CONFIG) -> AutopilotPolicy:
    return AutopilotPolicy(config, min_prefill=1, min_decode=1)


def test_a_prefills_speed_is_its_prompt_tokens_per_second_of_forward_time():
    pools = Pools(prompt_rate=15_000.0, wanting=20.0, prefill_speed=12_000.0)
    model = CapacityModel()
    first, last = pools.sample(), pools.sample()
    needs = model.needs([first, last], kv_target=0.85, tpot_slo_ms=None)
    assert model.prefill_rate is not None and abs(model.prefill_rate - 12_000.0) < 1.0
    assert needs is not None and abs(needs.prefill - 15_000.0 / 12_000.0) < 0.01


def test_a_standing_queue_is_shown_but_needs_no_server_while_the_arrivals_fit():
    pools = Pools(prompt_rate=10_000.0, wanting=20.0, queued=300_000.0, prefills=1)
    first, last = pools.sample(), pools.sample()
    needs = CapacityModel().needs([first, last], kv_target=1.0, tpot_slo_ms=None)
    assert needs is not None and abs(needs.prefill - 1.0) < 0.01
    assert "300000 queued" in needs.basis["prefill"]


def test_the_decode_step_is_fitted_from_the_moments_and_the_tpot_slo_bounds_the_batch():
    pools = Pools(prompt_rate=1000.0, wanting=40.0, step=StepTime(9000.0, 500.0))
    model = CapacityModel()
    first, last = pools.sample(), pools.sample()
    needs = model.needs([first, last], kv_target=1.0, tpot_slo_ms=30.0)
    assert model.step is not None
    assert abs(model.step.base_us - 9000.0) < 1.0 and abs(model.step.per_request_us - 500.0) < 0.1
    # (30 ms - 9 ms) / 0.5 ms = 42 requests within the SLO, but the cap is 32: 40 want a slot.
    assert needs is not None and abs(needs.decode - 40.0 / 32.0) < 0.01
    tighter = model.needs([first, last], kv_target=1.0, tpot_slo_ms=19.0)
    assert tighter is not None and abs(tighter.decode - 40.0 / 20.0) < 0.01


def test_without_capacity_counters_no_need_is_reckoned():
    plain = Sample(at=0.0, workers=(WorkerSignals("http://p", "prefill"),))
    later = dataclasses.replace(plain, at=5.0)
    needs = CapacityModel().needs([plain, later], kv_target=1.0, tpot_slo_ms=None)
    assert needs is None


def test_prefill_demand_beyond_its_pool_converts_a_decode_with_room():
    pools = Pools(prompt_rate=28_000.0, wanting=20.0)
    decisions = run(policy(), pools, 6)
    assert conversions(decisions) == [DECODE_TO_PREFILL]
    assert pools.prefills == 3
    reason = next(d.reason for d in decisions if d.action != HOLD)
    assert reason.startswith("prefill needs ")
    assert "of its 2 (28000 prompt tokens/s arriving" in reason


def test_a_prefill_backlog_the_remaining_decode_could_not_take_holds():
    """Issue 30's swing: a long prefill queue wanted a decode moved, and the requests it
    released flooded the one decode left. Counted as the decodes' need, it holds."""
    pools = Pools(prompt_rate=22_000.0, wanting=48.0, queued=600_000.0)
    decisions = run(policy(), pools, 8)
    assert conversions(decisions) == []
    assert "but the split that serves both best is 2P2D" in decisions[-1].reason


def test_a_fleet_short_everywhere_does_not_move_its_shortage_around():
    """The prefills need twice their servers and the decodes more than one of two: any split
    leaves a pool short, so nothing moves (on the Azure trace such moves flapped nine times)."""
    pools = Pools(prompt_rate=44_000.0, wanting=66.0)
    decisions = run(policy(), pools, 8)
    assert conversions(decisions) == []
    assert "but decode would need" in decisions[-1].reason


def test_a_donor_whose_need_stayed_high_lately_keeps_its_server():
    """The decodes needed 1.8 servers for a while a little earlier: with one of two gone they
    could not carry that again, whatever the window shows now; once that is older than
    peak_secs, the move is made."""
    autopilot = policy()
    pools = Pools(prompt_rate=12_000.0, wanting=56.0)
    run(autopilot, pools, 3)
    pools.prompt_rate, pools.wanting = 28_000.0, 20.0
    decisions = run(autopilot, pools, 6)
    assert conversions(decisions) == []
    assert "but decode would need" in decisions[-1].reason
    assert conversions(run(autopilot, pools, 6)) == [DECODE_TO_PREFILL]


def test_a_burst_in_a_few_of_the_donors_needs_does_not_hold_its_server():
    """A burst seen in two of the twelve needs of the last peak_secs is not a need the donor
    keeps coming back to: the prefills short of the arrivals get the decode while it is
    recent (the highest need of the minute would hold it: 1.2 of the 1 decode kept)."""
    config = dataclasses.replace(
        CONFIG, window_secs=5.0, sustain_secs=5.0, cooldown_secs=5.0, peak_secs=60.0
    )
    autopilot = policy(config)
    pools = Pools(prompt_rate=18_000.0, wanting=16.0)
    run(autopilot, pools, 10)
    pools.wanting = 60.0
    run(autopilot, pools, 1)
    pools.prompt_rate, pools.wanting = 28_000.0, 16.0
    assert conversions(run(autopilot, pools, 4)) == [DECODE_TO_PREFILL]


def test_a_wrong_split_gives_way_to_the_balanced_one():
    """3P1D with the decode overloaded: moving a prefill leaves the prefills fuller than the
    threshold rule's margin would allow, and still halves the fuller pool's load."""
    pools = Pools(prompt_rate=16_000.0, wanting=48.0, prefills=3)
    decisions = run(policy(), pools, 6)
    assert conversions(decisions) == [PREFILL_TO_DECODE]
    assert pools.prefills == 2


def test_decodes_over_their_servers_are_short_only_once_the_wait_after_prefill_passes_the_slo():
    """A burst the decodes drain within the TTFT SLO counts its queue for a slot as need but
    delays no answer past it: no prefill is taken for it until the wait passes the SLO."""
    autopilot = policy()
    pools = Pools(prompt_rate=16_000.0, wanting=48.0, prefills=3, decode_wait_ms=800.0)
    decisions = run(autopilot, pools, 6)
    assert conversions(decisions) == []
    assert "but absorbs it: wait after prefill p90 at most 800 ms" in decisions[-1].reason
    pools.decode_wait_ms = 2400.0
    assert conversions(run(autopilot, pools, 6)) == [PREFILL_TO_DECODE]


def test_a_prefill_is_not_taken_while_the_queue_would_wait_past_half_the_ttft_slo_on_the_rest():
    """Three prefills clearing a queue of 2M prompt tokens while the decode is short: one
    prefill fewer keeps up with the arrivals, but the queue would keep requests waiting 90 s
    or more on two; once it cleared, the prefill goes."""
    autopilot = policy()
    pools = Pools(prompt_rate=14_000.0, wanting=48.0, prefills=3, queued=2_000_000.0)
    decisions = run(autopilot, pools, 6)
    assert conversions(decisions) == []
    assert "but the prefills' queue would keep requests waiting" in decisions[-1].reason
    assert "on 2, over 1.0 s" in decisions[-1].reason
    pools.queued = 0.0
    assert conversions(run(autopilot, pools, 6)) == [PREFILL_TO_DECODE]


def test_a_steady_mix_reaches_the_best_split_from_either_wrong_start_and_holds():
    for start in (1, 7):
        pools = Pools(prompt_rate=32_000.0, wanting=100.0, prefills=start, size=8)
        decisions = run(policy(), pools, 120)
        assert pools.prefills == 4, (start, conversions(decisions))
        assert len(conversions(decisions)) == abs(start - 4)


def test_latencies_measured_under_the_split_before_do_not_decide():
    pools = Pools(prompt_rate=12_000.0, wanting=30.0)
    samples = []
    for _ in range(8):
        sample = pools.sample()
        samples.append(
            dataclasses.replace(sample, prefill_p90_ms=9000.0, decode_wait_p90_ms=9000.0)
        )
    decisions = [policy().step(s) for s in samples]
    assert all(d.action == HOLD for d in decisions)


def shifted(autopilot: AutopilotPolicy) -> list[Decision]:
    """A decode moved to the prefills of 2P4D, then the mix moves toward the decodes (the
    prefill share of the demand from 60% to 28%): moving it back would now pay."""
    pools = Pools(prompt_rate=28_000.0, wanting=60.0, size=6)
    assert conversions(run(autopilot, pools, 6)) == [DECODE_TO_PREFILL]
    pools.prompt_rate, pools.wanting = 16_000.0, 130.0
    return run(autopilot, pools, 12)


def test_a_conversion_is_not_undone_within_the_flip_guard_while_the_mix_moved_less():
    autopilot = policy(dataclasses.replace(CONFIG, flip_mix_change=0.4))
    later = shifted(autopilot)
    assert conversions(later) == []
    assert "would undo the conversion" in later[-1].reason


def test_a_mix_that_moved_enough_may_undo_a_conversion_within_the_flip_guard():
    assert conversions(shifted(policy())) == [PREFILL_TO_DECODE]


def test_a_conversion_that_made_attainment_worse_holds_its_direction_back():
    autopilot = policy()
    pools = Pools(prompt_rate=40_000.0, wanting=20.0, size=6, attained=0.9)
    assert conversions(run(autopilot, pools, 6)) == [DECODE_TO_PREFILL]
    pools.attained = 0.5  # the same traffic, served worse
    later = run(autopilot, pools, 12)
    assert conversions(later) == []
    assert autopilot.last_judgement == "decode to prefill made SLO attainment worse: 90% -> 50%"
    assert "backing off" in later[-1].reason


def test_a_conversion_is_not_judged_on_attainment_when_the_demand_moved():
    autopilot = policy()
    pools = Pools(prompt_rate=40_000.0, wanting=20.0, size=6, attained=0.9)
    assert conversions(run(autopilot, pools, 6)) == [DECODE_TO_PREFILL]
    pools.attained, pools.prompt_rate = 0.5, 48_000.0  # a surge, served worse
    judgements = []
    later = []
    for _ in range(12):
        later += run(autopilot, pools, 1)
        judgements.append(autopilot.last_judgement)
    assert any(
        j and j.startswith("decode to prefill not judged: the demand moved") for j in judgements
    )
    assert DECODE_TO_PREFILL in conversions(later)
    assert not any("backing off" in d.reason for d in later)


def test_a_large_fleet_moves_several_servers_at_once_up_to_max_moves():
    autopilot = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1, max_moves=4)
    pools = Pools(prompt_rate=200_000.0, wanting=200.0, prefills=16, size=32)
    decisions = run(autopilot, pools, 6)
    moved = [d for d in decisions if d.action != HOLD]
    assert [len(d.workers) for d in moved][:1] == [4]
    assert moved[0].desired == {"prefill": 20, "decode": 12}
    assert len(set(moved[0].workers)) == 4


def test_a_move_short_of_its_target_takes_the_next_step_a_window_later_not_a_cooldown():
    """A fleet of 32 that wants four decodes moved, two at once: the second pair follows once
    a window of samples confirms the need, not after the full cooldown."""
    config = dataclasses.replace(CONFIG, cooldown_secs=120.0)
    autopilot = AutopilotPolicy(config, min_prefill=1, min_decode=1, max_moves=2)
    pools = Pools(prompt_rate=200_000.0, wanting=200.0, prefills=16, size=32)
    moved = [d for d in run(autopilot, pools, 16) if d.action != HOLD]
    assert [len(d.workers) for d in moved][:2] == [2, 2]
    assert moved[1].at - moved[0].at <= config.window_secs + 2 * STEP


def test_a_move_takes_the_servers_the_needy_pool_is_short_of_not_the_balanced_split():
    """The prefills need 18 of their 16 and the decodes little: the balanced split is far
    off, but four servers bring the prefills to 90% of theirs (18 of 20), so four move though
    eight may."""
    autopilot = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1, max_moves=8)
    pools = Pools(prompt_rate=180_000.0, wanting=60.0, prefills=16, size=32)
    moved = [d for d in run(autopilot, pools, 6) if d.action != HOLD]
    assert moved[0].desired == {"prefill": 20, "decode": 12}


def test_a_move_that_took_its_whole_shortfall_waits_the_full_cooldown_for_the_next():
    """Four moved, all the prefills were short of: the demand rising again afterwards gets
    its next server after the cooldown, not a window later."""
    config = dataclasses.replace(CONFIG, cooldown_secs=120.0)
    autopilot = AutopilotPolicy(config, min_prefill=1, min_decode=1, max_moves=8)
    pools = Pools(prompt_rate=180_000.0, wanting=60.0, prefills=16, size=32)
    first = [d for d in run(autopilot, pools, 6) if d.action != HOLD]
    assert first[0].desired == {"prefill": 20, "decode": 12}
    pools.prompt_rate = 240_000.0
    later = [d for d in run(autopilot, pools, 30) if d.action != HOLD]
    assert later and later[0].at - first[0].at >= config.cooldown_secs


def test_a_pool_far_over_its_servers_takes_one_from_a_donor_that_keeps_up_at_its_limit():
    """3P1D with the decode at over twice its server and the prefills needing 1.9: the move
    leaves the two prefills at 95% of theirs, past the 90% margin but within their servers,
    and halves the decodes' load (real processes: held 24 s on the margin alone)."""
    pools = Pools(prompt_rate=19_000.0, wanting=80.0, prefills=3)
    decisions = run(policy(), pools, 6)
    assert conversions(decisions) == [PREFILL_TO_DECODE]
    assert pools.prefills == 2
