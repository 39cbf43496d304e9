"""bench/sglang_figures.py's statistics and report on fixed figures: latency summaries and the
router/direct ratios, conversion phases grouped per worker and direction, the markdown table.
The conversion plan keeps every round trip clear of SGLang 0.5.23's stale-endpoint bug. Pure
functions, no SGLang; the figures themselves belong in docs/PERFORMANCE.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang_cluster import SGLangServer

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def figs(monkeypatch: pytest.MonkeyPatch):
    """bench/ is a folder of scripts, not a package: import sglang_figures.py from it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import sglang_figures

    return sglang_figures


def conversion(worker: str, direction: str, status: str = "succeeded", **timings: float) -> dict:
    return {"worker": worker, "direction": direction, "status": status, "timings": timings}


def test_a_latency_summary_is_in_milliseconds_with_inclusive_p90(figs) -> None:
    summary = figs.latency_summary([i / 1000 for i in range(1, 11)])
    assert summary["n"] == 10
    assert summary["mean_ms"] == pytest.approx(5.5)
    assert summary["p50_ms"] == pytest.approx(5.5)
    assert summary["p90_ms"] == pytest.approx(9.1)


def test_the_ratio_is_router_over_direct_for_each_statistic(figs) -> None:
    figures = figs.overhead_figures([[0.1], [0.1], [0.1]], [[0.12], [0.12], [0.15]])
    assert figures["ratio"]["mean"] == pytest.approx(0.13 / 0.1)
    assert figures["ratio"]["p50"] == pytest.approx(1.2)
    assert figures["ratio"]["p90"] == pytest.approx(figures["router"]["p90_ms"] / 100)


def test_a_burst_on_one_batch_moves_the_pooled_mean_not_the_paired_median(figs) -> None:
    direct = [[0.1], [0.1], [0.5], [0.1], [0.1]]
    routed = [[0.11]] * 5
    ratio = figs.overhead_figures(direct, routed)["ratio"]
    assert ratio["mean"] == pytest.approx(0.11 / 0.18)
    assert ratio["paired"] == pytest.approx([1.1, 1.1, 1.1])


def test_conversions_are_grouped_per_worker_and_direction_in_order_of_appearance(figs) -> None:
    rows = figs.conversion_rows([
        conversion("d1", "decode -> prefill", drain_s=1.0, total_s=3.0),
        conversion("d1", "prefill -> decode", drain_s=0.5, total_s=2.0),
        conversion("d1", "decode -> prefill", drain_s=3.0, total_s=4.0),
        conversion("d1", "decode -> prefill", drain_s=2.0, total_s=9.0),
    ])  # fmt: skip
    assert [(r["worker"], r["direction"], r["n"]) for r in rows] == [
        ("d1", "decode -> prefill", 3),
        ("d1", "prefill -> decode", 1),
    ]
    assert rows[0]["phases"]["drain_s"] == {"median": 2.0, "max": 3.0}
    assert rows[0]["phases"]["total_s"] == {"median": 4.0, "max": 9.0}


def test_failed_conversions_are_counted_but_not_in_the_phase_figures(figs) -> None:
    rows = figs.conversion_rows([
        conversion("p1", "prefill -> decode", switch_s=0.2, total_s=1.0),
        conversion("p1", "prefill -> decode", "restored", switch_s=7.0, total_s=30.0),
    ])  # fmt: skip
    assert (rows[0]["n"], rows[0]["succeeded"]) == (2, 1)
    assert rows[0]["phases"]["switch_s"] == {"median": 0.2, "max": 0.2}


def test_a_phase_no_conversion_reported_is_left_out(figs) -> None:
    rows = figs.conversion_rows([conversion("d1", "decode -> prefill", total_s=1.0)])
    assert set(rows[0]["phases"]) == {"total_s"}


def test_the_markdown_report_shows_ratios_phases_and_failed_requests(figs) -> None:
    conversions = [conversion("d1", "decode -> prefill", drain_s=0.25, canary_s=0.5, total_s=2.0)]
    report = {
        "sglang": "0.5.23", "date": "2026-12-05 01:00 UTC", "commit": "abc1234",
        "loadavg_start": 3.0, "loadavg_end": 4.0, "clients": 3, "different_answers": 0,
        "overhead": {"1": figs.overhead_figures([[0.1], [0.1]], [[0.11], [0.11]])},
        "conversion_rows": figs.conversion_rows(conversions),
        "traffic": {"sent": 40, "failed": 1, "failures": ["502: bad gateway"]},
    }  # fmt: skip
    text = figs.markdown(report)
    assert (
        "| 1 | **router / direct** | | **1.10** | **1.10** | **1.10** | **1.10** (1.10-1.10) |"
        in text
    )
    assert "| d1 | decode -> prefill | 1 (1) | 0.25 / 0.25 | - | - | - | 0.50 / 0.50 " in text
    assert "40 sent, 1 failed (first: 502: bad gateway)." in text
    assert "commit abc1234" in text and "load average 3.0 at start" in text


def test_no_server_is_a_prefill_again_while_a_plain_decode_holds_its_old_endpoints(figs) -> None:
    """SGLang's decodes keep a prefill's endpoints until they switch themselves; only a patched
    decode can be told to forget them (docs/sglang-bugs.md, b). Every decode is taken to talk
    to every prefill between two conversions."""
    fleet = [
        SGLangServer("p0", "prefill", 0, 0),
        SGLangServer("p1", "prefill", 0, 0, patched=True),
        SGLangServer("d0", "decode", 0, 0),
        SGLangServer("d1", "decode", 0, 0, patched=True),
    ]
    role = {s.name: s.mode for s in fleet}
    held: dict[str, set[str]] = {s.name: set() for s in fleet}

    def traffic() -> None:
        for decode in (s for s in fleet if role[s.name] == "decode"):
            held[decode.name] |= {s.name for s in fleet if role[s.name] == "prefill"}

    traffic()
    plan = figs.conversion_plan(fleet, round_trips=3, prefill_round_trips=2)
    for step, (target, to) in enumerate(plan):
        if to == "prefill":
            stale = [s.name for s in fleet if not s.patched and target.name in held[s.name]]
            assert stale == [], (step, target.name)
        role[target.name], held[target.name] = to, set()
        traffic()
    assert plan.count((fleet[3], "prefill")) == 3
    assert plan.count((fleet[1], "decode")) == 2
