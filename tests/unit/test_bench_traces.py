"""The real traces the rebalancing benchmark replays: read from CSV, merged in time, cut to a
window of minutes, compressed, thinned by a seed, and counted in equal windows whose SLO
attainment and goodput add up. Pure functions, no processes."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def tr(monkeypatch: pytest.MonkeyPatch):
    """bench/ is a folder of scripts, not a package: import traces.py from it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import traces

    return traces


@pytest.fixture
def rb(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import rebalance

    return rebalance


def write_csv(path: Path, rows: list[tuple[str, int, int]]) -> Path:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"{stamp},{prompt},{answer}" for stamp, prompt, answer in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def request(tr, at: float, phase: int = 0):
    return tr.TraceRequest(at=at, phase=phase, prompt_tokens=100, output_tokens=10)


def test_a_trace_file_loads_as_offsets_from_its_first_request(tr, tmp_path: Path) -> None:
    path = write_csv(
        tmp_path / "t.csv",
        [
            ("2023-11-16 18:17:03.9799600", 4808, 10),
            ("2023-11-16 18:17:04.0319600", 3180, 8),
            ("2023-11-16 18:19:03.9799600", 12, 300),
        ],
    )
    trace = tr.offsets(tr.read_trace(path))
    assert [r.at for r in trace] == pytest.approx([0.0, 0.052, 120.0])
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [(4808, 10), (3180, 8), (12, 300)]
    assert {r.phase for r in trace} == {0}


def test_a_malformed_row_is_refused_with_its_line(tr, tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", [("2023-11-16 18:17:03", 10, 1), ("yesterday", 10, 1)])
    with pytest.raises(tr.TraceError, match=r"t\.csv:3"):
        tr.read_trace(path)


def test_the_shipped_traces_load_whole(tr) -> None:
    code = tr.read_trace(tr.resolve("azure_code"))
    conv = tr.read_trace(tr.resolve("azure_conv"))
    assert (len(code), len(conv)) == (8819, 19366)
    assert [r.stamp for r in code] == sorted(r.stamp for r in code)


def test_an_unknown_trace_name_lists_the_known_ones(tr) -> None:
    with pytest.raises(tr.TraceError, match="azure_code, azure_conv"):
        tr.resolve("azure_nope")


def test_merged_traces_interleave_by_time_and_ties_keep_the_order_given(tr) -> None:
    def logged(second: int, tokens: int):
        return tr.Logged(datetime(2023, 11, 16, 18, 0, second), tokens, 1)

    first = [logged(0, 1), logged(2, 2), logged(4, 3)]
    second = [logged(1, 10), logged(2, 20), logged(5, 30)]
    merged = tr.merge([first, second])
    assert [r.prompt_tokens for r in merged] == [1, 10, 2, 20, 3, 30]
    assert [r.at for r in tr.offsets(merged)] == [0, 1, 2, 2, 4, 5]


def test_a_window_keeps_its_minutes_and_starts_at_zero(tr) -> None:
    trace = [request(tr, at) for at in (59.9, 60.0, 90.0, 179.9, 180.0)]
    assert [r.at for r in tr.window(trace, 1, 3)] == pytest.approx([0.0, 30.0, 119.9])
    with pytest.raises(tr.TraceError):
        tr.window(trace, 3, 3)


def test_compression_divides_every_send_time_and_keeps_sizes(tr) -> None:
    trace = [tr.TraceRequest(at=60.0, phase=0, prompt_tokens=7, output_tokens=3)]
    assert tr.compress(trace, 6) == [tr.TraceRequest(10.0, 0, 7, 3)]
    with pytest.raises(tr.TraceError):
        tr.compress(trace, 0)


def test_thinning_with_the_same_seed_keeps_the_same_requests(tr) -> None:
    trace = [request(tr, float(i)) for i in range(1000)]
    assert tr.thin(trace, 0.3, seed=7) == tr.thin(trace, 0.3, seed=7)
    assert tr.thin(trace, 0.3, seed=7) != tr.thin(trace, 0.3, seed=8)
    assert tr.thin(trace, 1.0, seed=7) == trace


def test_thinning_keeps_close_to_the_share_asked(tr) -> None:
    trace = [request(tr, float(i)) for i in range(20000)]
    kept = len(tr.thin(trace, 0.45, seed=1))
    expected = 0.45 * len(trace)
    assert abs(kept - expected) < 5 * math.sqrt(expected * 0.55)


def test_windows_split_the_span_equally_by_send_time(tr) -> None:
    trace = [request(tr, at) for at in (0.0, 9.99, 10.0, 29.99, 30.0)]
    assert [r.phase for r in tr.in_windows(trace, 3, 30.0)] == [0, 0, 1, 2, 2]


def test_prepare_cuts_compresses_thins_and_counts_in_windows(tr) -> None:
    logged = [
        tr.Logged(datetime(2023, 11, 16, 18, m, s), 100, 10) for m in range(10) for s in (0, 30)
    ]
    replay = tr.prepare(logged, minutes=(2, 8), factor=6, keep=1.0, seed=0, windows=3)
    assert replay.duration == 60.0
    assert [r.at for r in replay.requests] == [5.0 * i for i in range(12)]
    assert [r.phase for r in replay.requests] == [i // 4 for i in range(12)]


def test_attainment_and_goodput_per_window_count_the_requests_sent_in_it(tr, rb) -> None:
    slo = rb.Slo(ttft_secs=1.0, tpot_secs=0.05)
    trace = tr.in_windows([request(tr, at) for at in (1.0, 2.0, 3.0, 11.0, 12.0)], 3, 30.0)
    outcomes = [
        rb.Outcome(trace[0], ttft=0.5, tpot=0.01),
        rb.Outcome(trace[1], ttft=1.5, tpot=0.01),
        rb.Outcome(trace[2], error="HTTP 503"),
        rb.Outcome(trace[3], ttft=0.2, tpot=0.01),
        rb.Outcome(trace[4], ttft=0.2, tpot=0.01),
    ]
    shares = rb.attainment_by_phase(outcomes, slo, 3)
    assert shares[:2] == [pytest.approx(1 / 3), 1.0]
    assert math.isnan(shares[2])
    assert rb.goodput_by_phase(outcomes, slo, 3, 10.0) == [0.1, 0.2, 0.0]
