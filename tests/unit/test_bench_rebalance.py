"""The rebalancing benchmark's trace and goodput: the trace is seeded and shifts phase as
specified, and goodput counts exactly the requests that met both SLOs. Pure functions, no
processes; the figures themselves belong in docs/PERFORMANCE.md."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def rb(monkeypatch: pytest.MonkeyPatch):
    """bench/ is a folder of scripts, not a package: import rebalance.py from it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import rebalance

    return rebalance


def test_the_same_seed_gives_the_same_trace_and_another_seed_another(rb) -> None:
    spec = rb.TraceSpec(seed=3, phases=2, phase_secs=10.0)
    assert rb.make_trace(spec) == rb.make_trace(rb.TraceSpec(seed=3, phases=2, phase_secs=10.0))
    assert rb.make_trace(spec) != rb.make_trace(rb.TraceSpec(seed=4, phases=2, phase_secs=10.0))


def test_phases_alternate_answer_heavy_and_prompt_heavy_shapes(rb) -> None:
    spec = rb.TraceSpec(seed=1, phases=4, phase_secs=30.0)
    trace = rb.make_trace(spec)
    for phase in rb.phases(spec):
        sent = [r for r in trace if r.phase == phase.index]
        shape = rb.ANSWER_HEAVY if phase.index % 2 == 0 else rb.PROMPT_HEAVY
        assert all(phase.start <= r.at < phase.end for r in sent)
        assert all(
            shape.prompt_tokens[0] <= r.prompt_tokens <= shape.prompt_tokens[1] for r in sent
        )
        assert all(
            shape.output_tokens[0] <= r.output_tokens <= shape.output_tokens[1] for r in sent
        )
    answer_heavy = [r for r in trace if r.phase == 0]
    prompt_heavy = [r for r in trace if r.phase == 1]
    assert min(r.prompt_tokens for r in prompt_heavy) > max(r.prompt_tokens for r in answer_heavy)
    assert max(r.output_tokens for r in prompt_heavy) < min(r.output_tokens for r in answer_heavy)


def test_arrivals_follow_each_phase_rate_times_the_load(rb) -> None:
    spec = rb.TraceSpec(seed=2, phases=2, phase_secs=200.0, load=0.5)
    trace = rb.make_trace(spec)
    for index, shape in enumerate(spec.shapes):
        expected = shape.rate * spec.load * spec.phase_secs
        count = sum(r.phase == index for r in trace)
        assert abs(count - expected) < 5 * math.sqrt(expected)


def test_goodput_counts_only_requests_meeting_both_slos(rb) -> None:
    slo = rb.Slo(ttft_secs=1.0, tpot_secs=0.05)
    request = rb.TraceRequest(at=0.0, phase=0, prompt_tokens=10, output_tokens=5)
    outcomes = [
        rb.Outcome(request, ttft=0.5, tpot=0.01),  # meets both
        rb.Outcome(request, ttft=1.0, tpot=0.05),  # exactly at both limits
        rb.Outcome(request, ttft=1.5, tpot=0.01),  # first token too late
        rb.Outcome(request, ttft=0.5, tpot=0.06),  # answer too slow
        rb.Outcome(request, error="HTTP 503"),  # failed
    ]
    assert rb.goodput(outcomes, slo, duration=4.0) == 0.5


def test_attainment_is_per_phase_of_sending(rb) -> None:
    slo = rb.Slo(ttft_secs=1.0, tpot_secs=0.05)
    first = rb.TraceRequest(at=1.0, phase=0, prompt_tokens=10, output_tokens=1)
    second = rb.TraceRequest(at=11.0, phase=1, prompt_tokens=10, output_tokens=5)
    outcomes = [
        rb.Outcome(first, ttft=0.2),
        rb.Outcome(second, ttft=0.2, tpot=0.01),
        rb.Outcome(second, ttft=3.0, tpot=0.01),
    ]
    assert rb.attainment_by_phase(outcomes, slo, 3)[:2] == [1.0, 0.5]
    assert math.isnan(rb.attainment_by_phase(outcomes, slo, 3)[2])
    assert rb.goodput_series(outcomes, slo, duration=20.0, bin_secs=10.0) == [0.1, 0.1]


def test_no_two_prompts_of_the_trace_share_a_prefix(rb) -> None:
    trace = rb.make_trace(rb.TraceSpec(seed=5, phases=2, phase_secs=20.0))
    heads = {tuple(rb.prompt_ids(r)[:16]) for r in trace}
    assert len(heads) == len(trace)
    assert rb.prompt_ids(trace[0]) == rb.prompt_ids(trace[0])


def test_a_fleet_of_eight_runs_a_quarter_half_and_three_quarters_prefills(rb) -> None:
    names = [c.name for c in rb.configurations("[autopilot]\n", 60.0, workers=8)]
    assert names == [
        "static 2P6D",
        "static 4P4D",
        "static 6P2D",
        "autopilot",
        "autopilot-restart",
    ]
    pilot = rb.configurations("[autopilot]\n", 60.0, workers=8, splits=(5,))[1]
    assert (pilot.prefill, pilot.decode) == (4, 4)


def test_scale_load_sends_the_requests_the_fleet_simulator_sends(rb) -> None:
    import fleet_sim

    args = rb.parse_args(
        ["--trace", "azure_code,azure_conv", "--trace-window", "18:19", "--compress", "6",
         "--keep", "0.45", "--workers", "16", "--scale-load"]
    )  # fmt: skip
    work = rb.trace_workload(args)
    scaled = rb.scaled_workload(work, args.load_scale, args.seed)
    simulated = fleet_sim.in_windows(
        fleet_sim.scale_load(work.trace, 4, args.seed), len(work.heads), work.duration
    )
    assert args.load_scale == 4
    assert len(scaled.trace) == 4 * len(work.trace)
    assert scaled.trace == simulated


def test_the_simulator_replays_each_configuration_beside_the_real_one(rb) -> None:
    trace = [
        rb.TraceRequest(at=0.5 * i, phase=0, prompt_tokens=100, output_tokens=5) for i in range(4)
    ]
    work = rb.Workload(trace, 2.0, ["W1"], "four small requests", [], "", 1.0)
    served = [rb.Outcome(r, ttft=0.1, tpot=0.01) for r in trace[:2]]
    run = rb.Run(rb.Configuration("static 1P1D", 1, 1), served + [
        rb.Outcome(r, error="HTTP 503") for r in trace[2:]
    ])  # fmt: skip
    args = rb.parse_args(["--decode-batch-cap", "32", "--workers", "2"])
    lines = rb.simulated_lines([run], work, rb.Slo(), args)
    assert "| static 1P1D | 1.00 | 2.00 | +100.0% | 0 | 0 | 2 / 0 |" in "\n".join(lines)


def test_scaling_the_load_needs_a_trace_and_splits_must_fit_the_fleet(rb) -> None:
    for argv in (["--scale-load"], ["--load-scale", "2"], ["--workers", "8", "--splits", "8"]):
        with pytest.raises(SystemExit):
            rb.parse_args(argv)
