"""The fleet simulator (bench/fleet_model.py): its durations are the timing model's arithmetic,
its pools saturate at the timing model's capacity, its samples drive the router's own autopilot
policy, the capacity counters it reports grow as the timing model says, and a scaled load keeps
the trace's shape. Pure and fast: no processes, a few hundred modeled requests at most."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from pd_router.control.autopilot.policy import AutopilotPolicy
from pd_worker.timing import profile

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch):
    """bench/ is a folder of scripts, not a package: import fleet_model.py from it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import fleet_model

    yield fleet_model
    sys.modules.pop("fleet_model", None)


def requests(sim, count: int, every: float, prompt: int, output: int) -> list:
    from traces import TraceRequest

    return [TraceRequest(i * every, 0, prompt, output) for i in range(count)]


def test_a_request_through_an_idle_fleet_takes_the_timing_models_time(sim) -> None:
    timing = profile("h100-8b", max_running_requests=32)
    prompt, output = 3000, 50
    [req] = sim.Fleet(timing, 1, 1).run(requests(sim, 1, 1.0, prompt, output)).requests
    first_step = timing.decode_step_secs(1, prompt)
    assert req.ttft == pytest.approx(
        timing.prefill_secs(prompt) + timing.transfer_secs(prompt) + first_step
    )
    later_steps = sum(timing.decode_step_secs(1, prompt + i) for i in range(1, output))
    assert req.tpot == pytest.approx(later_steps / (output - 1))


def test_a_saturated_prefill_serves_requests_at_its_capacity(sim) -> None:
    timing = profile("h100-8b", max_running_requests=32)
    prompt = 4096  # four prompts fill a forward's 16,384-token budget
    capacity = 4 / timing.prefill_secs(4 * prompt)  # requests per second
    trace = requests(sim, 240, 1 / (2 * capacity), prompt, 8)  # twice what it can take
    result = sim.Fleet(timing, 1, 3).run(trace)
    prefilled = sorted(r.prefilled_at for r in result.requests)
    since = prefilled[40]  # a forward's end, once the queue stands
    served = sum(t > since for t in prefilled) / (prefilled[-1] - since)
    assert served == pytest.approx(capacity, rel=0.01)


def test_a_conversion_the_policy_applies_moves_the_worker_after_drain_and_switch(sim) -> None:
    timing = profile("h100-8b", max_running_requests=32)
    import fleet_sim

    config = fleet_sim.autopilot_config(fleet_sim.Slo())  # bench/rebalance.py's [autopilot]
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    trace = requests(sim, 400, 0.05, 6000, 20)  # prompts for two prefills, on one
    result = sim.Fleet(timing, 1, 3, policy=policy).run(trace)
    first = result.conversions[0]
    assert (first.from_role, first.to_role) == ("decode", "prefill")
    assert result.decisions[0].worker == first.url and result.decisions[0].applied
    assert first.started <= first.drained
    assert first.ended == pytest.approx(first.drained + timing.switch_secs)
    during = [(p, d) for at, p, d in result.pools if first.started <= at < first.ended]
    after = [(p, d) for at, p, d in result.pools if at >= first.ended]
    assert during and set(during) == {(1, 2)}
    assert after[0] == (2, 2)


def test_the_prefill_counters_ratio_is_the_per_token_speed(sim) -> None:
    timing = profile("h100-8b", max_running_requests=32, prefill_batch_overhead_secs=0.0)
    fleet = sim.Fleet(timing, 1, 1)
    fleet.run(requests(sim, 30, 0.01, 1500, 4))
    signals = fleet.signals(fleet.by_url["sim://p0"])
    assert signals.prefill_tokens == 30 * 1500
    speed = signals.prefill_tokens / (signals.prefill_busy_us / 1e6)
    assert speed == pytest.approx(1 / timing.prefill_secs_per_token, rel=1e-4)


def test_the_decode_moments_sum_steps_of_the_timing_models_length(sim) -> None:
    timing = profile("h100-8b", max_running_requests=8, decode_step_per_ctx_token_secs=0.0)
    fleet = sim.Fleet(timing, 1, 1)
    fleet.run(requests(sim, 20, 0.02, 200, 30))
    n, sum_b, sum_us, _, _, generated = fleet.signals(fleet.by_url["sim://d0"]).decode_moments
    base_us = timing.decode_step_base_secs * 1e6
    assert generated == 20 * 30
    assert sum_b == generated
    assert sum_us == pytest.approx(n * base_us + sum_b * timing.decode_step_per_req_secs * 1e6)


def test_a_scaled_load_sends_each_request_k_times_before_the_next_one(sim) -> None:
    import fleet_sim

    trace = requests(sim, 10, 0.5, 100, 10)
    scaled = fleet_sim.scale_load(trace, 4, seed=1)
    assert len(scaled) == 40
    for original, following in itertools.pairwise(trace):
        copies = [r for r in scaled if original.at <= r.at < following.at]
        assert len(copies) == 4
        assert all(r.prompt_tokens == original.prompt_tokens for r in copies)
    assert scaled == fleet_sim.scale_load(trace, 4, seed=1)


def test_autopilot_restart_pays_a_restart_for_each_switch(sim) -> None:
    """The restart-based planner (bench/rebalance.py's autopilot-restart): the same decisions,
    each switch taking --restart-secs instead of the timing model's switch time."""
    import fleet_sim

    timing = profile("h100-8b", max_running_requests=32)
    trace = requests(sim, 400, 0.05, 6000, 20)  # prompts for two prefills, on one
    work = fleet_sim.Workload(trace, 20.0, ["W1"], "steady", [], "", 1.0)
    [_, restart] = fleet_sim.setups(4, "autopilot", start=1, restart_secs=60.0)
    assert restart.name.startswith("autopilot-restart") and restart.switch_secs == 60.0
    run = fleet_sim.simulate(restart, trace, timing, work, fleet_sim.Slo(), seed=0)
    first = run.result.conversions[0]
    assert first.ended == pytest.approx(first.drained + 60.0)


def test_the_best_split_per_window_takes_each_windows_best_static_goodput(sim) -> None:
    import fleet_sim

    def static(prefill: int, by_window: list[float]) -> fleet_sim.SimRun:
        setup = fleet_sim.Setup(f"static {prefill}P", prefill, 4 - prefill)
        result = sim.FleetResult([])
        return fleet_sim.SimRun(setup, result, sum(by_window) / 2, [], by_window, 0, 0.0, "")

    runs = [static(1, [10.0, 2.0]), static(2, [6.0, 6.0]), static(3, [1.0, 9.0])]
    best, ceiling = fleet_sim.per_window_best(runs)
    assert [r.setup.prefill for r in best] == [1, 3]
    assert ceiling == pytest.approx((10.0 + 9.0) / 2)


def test_static_splits_given_replace_the_sweep(sim) -> None:
    import fleet_sim

    static = fleet_sim.setups(512, "static", static_splits=[336, 320])
    assert [(s.prefill, s.decode) for s in static] == [(320, 192), (336, 176)]


def test_a_decode_step_given_replaces_the_profiles_fixed_part(sim) -> None:
    import fleet_sim

    default = fleet_sim.fleet_timing(32)
    slower = fleet_sim.fleet_timing(32, decode_step_ms=9.5)
    assert slower.decode_step_secs(1) - default.decode_step_secs(1) == pytest.approx(0.0005)
    assert slower.max_running_requests == 32
