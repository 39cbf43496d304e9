"""The autopilot's decision policy on recorded signal sequences (no processes, no clock)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from pd_router.control.autopilot.policy import (
    DECODE_TO_PREFILL,
    HOLD,
    PREFILL_TO_DECODE,
    AutopilotConfig,
    AutopilotPolicy,
    Decision,
)
from pd_router.control.autopilot.signals import Sample, WorkerSignals, worker_from_loads

CONFIG = AutopilotConfig(
    mode="auto",
    interval_secs=5.0,
    window_secs=20.0,
    sustain_secs=30.0,
    cooldown_secs=60.0,
    ttft_slo_ms=500.0,
    decode_kv_usage=0.85,
    margin=0.8,
    hysteresis=0.1,
)


def cluster(
    prefills: int, decodes: int, kv: float, decode_running: Iterable[int] = ()
) -> tuple[WorkerSignals, ...]:
    """``prefills`` idle prefills and ``decodes`` decodes at KV usage ``kv`` (0..1)."""
    running = list(decode_running) or [4] * decodes
    workers = [WorkerSignals(f"http://p{i}", "prefill") for i in range(prefills)]
    workers += [
        WorkerSignals(
            f"http://d{i}",
            "decode",
            inflight=running[i],
            running=running[i],
            token_usage=kv,
            used_tokens=1000 * running[i],
        )
        for i in range(decodes)
    ]
    return tuple(workers)


def trace(ttfts: Iterable[float], workers: tuple[WorkerSignals, ...], start: float = 0.0):
    """One sample every 5 s with the given prefill TTFT p90s."""
    for i, ttft in enumerate(ttfts):
        yield Sample(at=start + 5.0 * i, workers=workers, prefill_p90_ms=ttft)


def run(policy: AutopilotPolicy, samples: Iterable[Sample]) -> list[Decision]:
    return [policy.step(s) for s in samples]


def conversions(decisions: Iterable[Decision]) -> list[Decision]:
    return [d for d in decisions if d.converts]


def applied_split(
    policy: AutopilotPolicy,
    ttft: Iterator[float],
    kv: Iterator[float],
    steps: int,
    start: tuple[int, int] = (2, 2),
) -> list[Decision]:
    """Feed ``steps`` samples from a ``start`` split (prefills, decodes), applying each
    conversion to the cluster the next sample shows."""
    prefills, decodes = start
    decisions = []
    for i in range(steps):
        workers = cluster(prefills, decodes, next(kv))
        decision = policy.step(Sample(at=5.0 * i, workers=workers, prefill_p90_ms=next(ttft)))
        decisions.append(decision)
        prefills, decodes = decision.desired["prefill"], decision.desired["decode"]
    return decisions


def test_persistent_prefill_overload_converts_a_decode():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    decisions = run(policy, trace([840.0] * 8, cluster(2, 4, 0.41)))
    converted = conversions(decisions)
    assert len(converted) == 1
    assert converted[0].at == 30.0
    assert converted[0].action == DECODE_TO_PREFILL
    assert (converted[0].from_role, converted[0].to_role) == ("decode", "prefill")
    assert converted[0].desired == {"prefill": 3, "decode": 3}
    assert all(d.action == HOLD for d in decisions if d.at < 30.0)


def test_persistent_decode_overload_converts_the_prefill_with_fewest_in_flight():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    workers = (
        WorkerSignals("http://p0", "prefill", inflight=5),
        WorkerSignals("http://p1", "prefill", inflight=1),
        WorkerSignals("http://p2", "prefill", inflight=3),
        *cluster(0, 2, 0.97),
    )
    converted = conversions(run(policy, trace([100.0] * 8, workers)))
    assert [(d.action, d.worker) for d in converted] == [(PREFILL_TO_DECODE, "http://p1")]
    assert "decode KV 97% > 85% for 30 s" in converted[0].reason


def test_short_spike_does_not_convert():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    ttfts = [200.0] * 4 + [900.0] * 3 + [200.0] * 20
    decisions = run(policy, trace(ttfts, cluster(2, 4, 0.41)))
    assert conversions(decisions) == []


def test_cooldown_holds_after_a_conversion():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    decisions = run(policy, trace([840.0] * 40, cluster(2, 6, 0.2)))
    converted = conversions(decisions)
    assert len(converted) >= 2
    assert converted[1].at - converted[0].at >= CONFIG.cooldown_secs
    in_cooldown = [d for d in decisions if converted[0].at < d.at < converted[0].at + 60.0]
    assert in_cooldown and all("cooldown" in d.reason for d in in_cooldown)


def test_no_decision_while_a_conversion_runs():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    workers = cluster(2, 4, 0.41)
    samples = [
        Sample(at=5.0 * i, workers=workers, prefill_p90_ms=840.0, converting=True)
        for i in range(12)
    ]
    decisions = run(policy, samples)
    assert conversions(decisions) == []
    assert decisions[-1].reason == "a conversion is running"


def test_minimum_pool_size_holds():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=2)
    decisions = run(policy, trace([840.0] * 12, cluster(1, 2, 0.05)))
    assert conversions(decisions) == []
    assert "decode pool at its minimum (2, min 2)" in decisions[-1].reason


def test_donor_that_would_go_over_its_margin_is_kept():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    decisions = run(policy, trace([840.0] * 12, cluster(2, 3, 0.60)))
    assert conversions(decisions) == []
    assert "decode KV 60% would be 90% with one fewer" in decisions[-1].reason


def test_both_pools_over_holds():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    decisions = run(policy, trace([840.0] * 12, cluster(2, 4, 0.99)))
    assert conversions(decisions) == []
    assert decisions[-1].reason.startswith("both pools over target")


def test_recommend_mode_decides_but_applies_nothing():
    config = dataclasses.replace(CONFIG, mode="recommend")
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    converted = conversions(run(policy, trace([840.0] * 8, cluster(2, 4, 0.41))))
    assert len(converted) == 1
    assert converted[0].mode == "recommend"
    assert not converted[0].applied


def test_recommend_mode_holds_for_the_cooldown_after_a_recommendation_and_says_so():
    config = dataclasses.replace(CONFIG, mode="recommend")
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    decisions = run(policy, trace([840.0] * 10, cluster(2, 4, 0.41)))
    held = [d for d in decisions if d.at > conversions(decisions)[0].at]
    assert held[0].reason.startswith("cooldown: last recommendation 5 s ago")
    assert not any("conversion ended" in d.reason for d in decisions)


def test_auto_mode_applies_its_conversion():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    converted = conversions(run(policy, trace([840.0] * 8, cluster(2, 4, 0.41))))
    assert converted[0].applied


def test_no_flapping_on_a_trace_at_the_boundary():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    ttft = iter([470.0, 540.0, 520.0, 490.0, 545.0, 505.0] * 40)
    kv = iter([0.20, 0.30] * 120)
    decisions = applied_split(policy, ttft, kv, 240)
    assert conversions(decisions) == []


def test_no_reversal_after_the_load_settles_at_the_boundary():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    ttft = iter([900.0] * 10 + [470.0, 540.0, 520.0, 490.0, 545.0, 505.0] * 40)
    kv = iter([0.30] * 10 + [0.40, 0.55, 0.50, 0.45] * 60)
    decisions = applied_split(policy, ttft, kv, 240)
    assert [d.action for d in conversions(decisions)] == [DECODE_TO_PREFILL]


def test_the_decode_with_the_least_remaining_work_is_chosen():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    workers = cluster(2, 4, 0.30, decode_running=[6, 2, 9, 3])
    converted = conversions(run(policy, trace([840.0] * 8, workers)))
    assert converted[0].worker == "http://d1"
    assert converted[0].cost is not None
    assert "waits for 2 running answers (2000 KV tokens)" in converted[0].cost


def test_the_reason_names_the_numbers():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    converted = conversions(run(policy, trace([840.0] * 8, cluster(2, 4, 0.41))))
    assert converted[0].reason.startswith(
        "prefill time to prefill p90 840 ms > 500 ms for 30 s; "
        "decode KV 41% would be 55% with one fewer; convert http://d0:"
    )


def test_utilisation_thresholds_without_slos():
    config = dataclasses.replace(CONFIG, ttft_slo_ms=None, prefill_queue_tokens=4096.0)
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    prefills = tuple(
        WorkerSignals(f"http://p{i}", "prefill", queued_prefill_tokens=9000) for i in range(2)
    )
    samples = [Sample(at=5.0 * i, workers=prefills + cluster(0, 4, 0.3)) for i in range(8)]
    converted = conversions(run(policy, samples))
    assert converted[0].reason.startswith(
        "prefill queued tokens per worker 9000 tokens > 4096 tokens for 30 s"
    )


def test_requests_refused_for_lack_of_a_worker_count_as_overload():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    workers = cluster(2, 4, 0.30)
    samples = [
        Sample(at=5.0 * i, workers=workers, prefill_p90_ms=100.0, no_worker_503s={"prefill": 2})
        for i in range(8)
    ]
    converted = conversions(run(policy, samples))
    assert converted and converted[0].to_role == "prefill"
    assert "requests refused for lack of a prefill" in converted[0].reason


def test_loads_of_several_dp_ranks_are_summed():
    body = {
        "loads": [
            {
                "num_running_reqs": 3,
                "num_waiting_reqs": 1,
                "num_used_tokens": 300,
                "max_total_num_tokens": 1000,
                "num_waiting_uncached_tokens": 50,
            },
            {
                "num_running_reqs": 2,
                "num_waiting_reqs": 0,
                "num_used_tokens": 100,
                "max_total_num_tokens": 1000,
                "num_waiting_uncached_tokens": 0,
            },
        ]
    }
    body["loads"][0]["queues"] = {"waiting": 1}
    worker = worker_from_loads("http://d0", "decode", 4, body)
    assert (worker.running, worker.waiting, worker.used_tokens) == (5, 1, 400)
    assert worker.waiting_for_slot == 1
    assert worker.token_usage == 0.2
    assert worker.queued_prefill_tokens == 50


def test_a_prefills_bootstrap_queue_counts_as_queued_prompt_tokens():
    """Real SGLang 0.5.23 under load: ten requests wait in the prefill's bootstrap queue, which
    ``num_waiting_uncached_tokens`` does not count; ``num_total_tokens`` does (a /v1/loads rank
    read from a real prefill, trimmed)."""
    rank = {
        "num_waiting_reqs": 10,
        "num_used_tokens": 2660,
        "num_total_tokens": 15962,
        "max_total_num_tokens": 4096,
        "num_waiting_uncached_tokens": 0,
        "disaggregation": {"mode": "prefill", "prefill_bootstrap_queue_reqs": 10},
    }
    prefill = worker_from_loads("http://p0", "prefill", 12, {"loads": [rank]})
    assert prefill.queued_prefill_tokens == 15962 - 2660
    decode = worker_from_loads("http://d0", "decode", 12, {"loads": [rank]})
    assert decode.queued_prefill_tokens == 0


def decodes_with_slots(running: int, waiting: int, count: int = 2, kv: float = 0.1):
    """``count`` decodes with 8 batch slots each, ``running`` and ``waiting`` requests."""
    return tuple(
        WorkerSignals(f"http://d{i}", "decode", inflight=running + waiting, running=running,
                      waiting=waiting, waiting_for_slot=waiting, token_usage=kv, max_running=8)
        for i in range(count)
    )  # fmt: skip


def test_decodes_short_of_batch_slots_convert_a_prefill():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    workers = cluster(2, 0, 0.0) + decodes_with_slots(running=8, waiting=5)
    samples = [Sample(at=5.0 * i, workers=workers, prefill_p90_ms=40.0) for i in range(8)]
    converted = conversions(run(policy, samples))
    assert [d.action for d in converted] == [PREFILL_TO_DECODE]
    assert converted[0].reason.startswith("decode batch slots in demand 162% > 100% for 30 s")


def test_decode_requests_waiting_for_their_prefill_are_not_slot_demand():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    decodes = tuple(
        dataclasses.replace(w, waiting=40, waiting_for_slot=0)
        for w in decodes_with_slots(running=4, waiting=0)
    )
    samples = [
        Sample(at=5.0 * i, workers=cluster(2, 0, 0.0) + decodes, prefill_p90_ms=40.0)
        for i in range(8)
    ]
    decisions = run(policy, samples)
    assert conversions(decisions) == []
    assert "decode batch slots in demand 50%" in decisions[-1].reason


def test_decode_kv_reserved_for_requests_waiting_for_their_prefill_is_not_decode_load():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    decodes = tuple(
        WorkerSignals(f"http://d{i}", "decode", running=4, waiting=12, token_usage=0.6)
        for i in range(2)
    )
    samples = [
        Sample(at=5.0 * i, workers=cluster(2, 0, 0.0) + decodes, prefill_p90_ms=840.0)
        for i in range(8)
    ]
    converted = conversions(run(policy, samples))
    assert [d.action for d in converted] == [DECODE_TO_PREFILL]
    assert "decode KV 15% would be 30% with one fewer" in converted[0].reason


def test_a_slow_first_token_after_the_prefill_answered_blames_the_decodes():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    samples = [
        Sample(at=5.0 * i, workers=cluster(3, 2, 0.2), prefill_p90_ms=90.0,
               decode_wait_p90_ms=800.0)
        for i in range(8)
    ]  # fmt: skip
    converted = conversions(run(policy, samples))
    assert [d.action for d in converted] == [PREFILL_TO_DECODE]
    assert "decode wait after prefill p90 800 ms > 500 ms" in converted[0].reason


def test_a_latency_within_target_is_not_scaled_as_if_it_were_a_load():
    config = dataclasses.replace(CONFIG, tpot_slo_ms=30.0)
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    workers = cluster(1, 0, 0.0) + decodes_with_slots(running=1, waiting=0)
    samples = [
        Sample(at=5.0 * i, workers=workers, prefill_p90_ms=840.0, tpot_p90_ms=12.0)
        for i in range(8)
    ]
    converted = conversions(run(policy, samples))
    assert [d.action for d in converted] == [DECODE_TO_PREFILL]


def test_cooldown_counts_from_the_end_of_the_conversion():
    policy = AutopilotPolicy(CONFIG, min_prefill=1, min_decode=1)
    workers = cluster(2, 6, 0.2)
    busy = [Sample(at=5.0 * i, workers=workers, prefill_p90_ms=840.0) for i in range(7)]
    converting = [
        Sample(at=35.0 + 5.0 * i, workers=workers, prefill_p90_ms=840.0, converting=True)
        for i in range(20)
    ]
    after = [Sample(at=135.0 + 5.0 * i, workers=workers, prefill_p90_ms=840.0) for i in range(20)]
    decisions = run(policy, busy + converting + after)
    converted = conversions(decisions)
    assert [d.at for d in converted] == [30.0, 190.0]
    assert next(d for d in decisions if d.at == 185.0).reason.startswith(
        "cooldown: last conversion ended 55 s ago"
    )


def test_a_pool_still_over_target_after_a_conversion_gets_the_next_without_a_new_sustain():
    config = dataclasses.replace(CONFIG, cooldown_secs=10.0)
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    decisions = applied_split(policy, iter([840.0] * 40), iter([0.1] * 40), 40, start=(2, 4))
    assert [d.at for d in conversions(decisions)][:2] == [30.0, 40.0]


def test_a_pool_back_within_target_after_a_conversion_gets_no_second():
    config = dataclasses.replace(CONFIG, cooldown_secs=10.0)
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    ttft = iter([840.0] * 7 + [300.0] * 40)
    decisions = applied_split(policy, ttft, iter([0.1] * 47), 47, start=(2, 4))
    assert [d.at for d in conversions(decisions)] == [30.0]


def test_a_pool_whose_queue_drains_gets_no_second_server_while_its_latency_lags():
    config = dataclasses.replace(CONFIG, cooldown_secs=10.0, prefill_queue_tokens=4096.0)
    policy = AutopilotPolicy(config, min_prefill=1, min_decode=1)
    queues = [40000] * 7 + [int(40000 * 0.7**i) for i in range(12)]
    decisions = []
    prefills, decodes = 2, 4
    for i, queued in enumerate(queues):
        workers = tuple(
            WorkerSignals(f"http://p{j}", "prefill", queued_prefill_tokens=queued)
            for j in range(prefills)
        ) + cluster(0, decodes, 0.1)
        decision = policy.step(Sample(at=5.0 * i, workers=workers, prefill_p90_ms=3000.0))
        decisions.append(decision)
        prefills, decodes = decision.desired["prefill"], decision.desired["decode"]
    assert [d.at for d in conversions(decisions)] == [30.0]
    assert "over, falling," in decisions[-3].reason


def test_loads_follow_the_pools_while_a_conversion_runs_without_joining_the_window():
    policy = AutopilotPolicy(CONFIG, 1, 1)
    run(policy, trace([100.0] * 4, cluster(2, 2, kv=0.2)))
    before = policy.loads["decode"].measure.value
    policy.step(Sample(at=20.0, workers=cluster(2, 2, kv=0.7), converting=True))
    assert policy.loads["decode"].measure.value > before
    policy.step(Sample(at=25.0, workers=cluster(2, 2, kv=0.2), prefill_p90_ms=100.0))
    assert policy.loads["decode"].measure.value == before
