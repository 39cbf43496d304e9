"""The scaling benchmark's pure helpers: how it splits the cores, which setups a run names,
how the load is spread over several generator processes and merged back, and which goals its
report declares met. Figures belong in docs/PERFORMANCE.md."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/ is a folder of scripts, not a package: make its modules importable."""
    monkeypatch.syspath_prepend(str(BENCH))


def test_sixteen_cores_give_the_router_six_and_keep_workers_and_generators_apart(
    bench_modules: None,
) -> None:
    from scale import plan_cores

    plan = plan_cores(range(16), router=6)
    assert plan.router == (10, 11, 12, 13, 14, 15)
    assert (plan.backends, plan.loadgens) == ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))
    assert not plan.shared


def test_two_cores_give_the_router_one_and_the_rest_share_the_other(bench_modules: None) -> None:
    from scale import plan_cores

    plan = plan_cores([0, 1], router=1)
    assert (plan.router, plan.backends, plan.loadgens) == ((1,), (0,), (0,))
    assert plan.shared
    assert "sharing 1 core (0)" in plan.describe()


def test_shared_cores_put_every_part_on_every_core(bench_modules: None) -> None:
    from scale import shared_plan

    plan = shared_plan([1, 0])
    assert (plan.router, plan.backends, plan.loadgens) == ((0, 1), (0, 1), (0, 1))
    assert plan.router_shared
    assert "sharing 2 cores (0,1), unpinned" in plan.describe()


@pytest.mark.parametrize(("router", "backends"), [(0, None), (16, None), (6, 10), (6, 0)])
def test_a_plan_without_cores_for_each_part_is_refused(
    bench_modules: None, router: int, backends: int | None
) -> None:
    from scale import plan_cores

    with pytest.raises(ValueError):
        plan_cores(range(16), router=router, backends=backends)


def test_a_baseline_setup_runs_the_pd_router_of_the_baseline_venv(
    bench_modules: None, tmp_path: Path
) -> None:
    from scale import parse_setups, setup_peers

    (base,) = parse_setups("1base", tmp_path)
    assert (base.name, base.count, base.venv) == ("pd-router --workers 1 (baseline)", 1, tmp_path)
    (peer,) = setup_peers(base, (10,))
    assert peer.venv == tmp_path.resolve()
    with pytest.raises(ValueError, match="--baseline"):
        parse_setups("1base")


def test_setups_name_smg_worker_counts_and_separate_processes(bench_modules: None) -> None:
    from scale import parse_setups

    setups = parse_setups("smg,smg1,1,6,6s,1")
    assert [s.name for s in setups] == [
        "smg",
        "smg on 1 core",
        "pd-router --workers 1",
        "pd-router --workers 6",
        "6 pd-router processes",
    ]
    router = (10, 11, 12, 13, 14, 15)
    assert [s.multiple(router) for s in setups] == [6, 1, 1, 6, 6]
    assert [s.cores(router) for s in setups[:3]] == [router, (10,), router]


def test_the_workers_flag_goes_to_a_pd_router_that_knows_it_or_needs_it(
    bench_modules: None,
) -> None:
    from peers import Topology
    from proc_cpu import pinned
    from scale import Setup, setup_peers

    topology = Topology(prefills=(("http://127.0.0.1:1", 2),), decodes=("http://127.0.0.1:3",))
    old_one, one, six = (
        setup_peers(Setup("workers", n), [3], workers_flag=flag)
        for n, flag in ((1, False), (1, True), (6, False))
    )
    separate = setup_peers(Setup("separate", 2), [3])
    argv_old = old_one[0].argv(topology, "127.0.0.1", 8000)
    prefix = pinned([], [3])
    assert argv_old[: len(prefix)] == prefix and "--workers" not in argv_old
    assert one[0].argv(topology, "127.0.0.1", 8000)[-2:] == ["--workers", "1"]
    assert six[0].argv(topology, "127.0.0.1", 8000)[-2:] == ["--workers", "6"]
    assert len({peer.name for peer in separate}) == 2


def test_clients_spread_over_generators_reach_each_router_in_turn(bench_modules: None) -> None:
    from scale import rotated, split_concurrency

    shares = split_concurrency(64, 5)
    assert shares == [13, 13, 13, 13, 12]
    urls, targets, offset = ["a", "b", "c"], [], 0
    for share in shares:
        mine = rotated(urls, offset)
        targets += [mine[i % len(mine)] for i in range(share)]
        offset += share
    assert targets == [urls[k % 3] for k in range(64)]


def test_merged_generators_sum_requests_and_keep_the_busiest_generator(
    bench_modules: None,
) -> None:
    from scale import merge_segments

    def part(completed: int, loadgen_cpu_s: float, router_cpu_s: float) -> dict:
        return {
            "completed": completed, "errors": 1, "error_samples": ["x"], "window_s": 2.0,
            "latencies_ms": [1.0] * completed, "ttft_ms": [], "router_cpu_s": router_cpu_s,
            "backend_cpu_s": router_cpu_s, "loadgen_cpu_s": loadgen_cpu_s,
        }  # fmt: skip

    merged = merge_segments([part(10, 1.0, 3.0), part(20, 1.8, 0.0)])
    assert (merged["completed"], merged["errors"], len(merged["latencies_ms"])) == (30, 2, 30)
    assert (merged["router_cpu_s"], merged["loadgen_cpu_s"]) == (3.0, 2.8)
    assert merged["loadgen_peak"] == pytest.approx(0.9)


def _cell(completed: int, cpu_s: float, latency_ms: float):
    from scale import Cell

    c = Cell()
    c.figures.completed, c.figures.window_s, c.figures.router_cpu_s = completed, 1.0, cpu_s
    c.figures.latencies_ms = [latency_ms] * 10
    return c


def _goal_lines(setups: str, cores: int, router_cores: int, cells: dict) -> list[str]:
    """Goal lines of a run on ``cores`` cores, ``router_cores`` of them the routers' (0: all
    shared)."""
    from overhead import BenchConfig
    from scale import ScaleConfig, goal_lines, parse_setups, plan_cores, shared_plan

    load = BenchConfig((), ("stream",), 64, 1, 1, 1, 16, 2, 2, 0, "stub", Path("."))
    plan = plan_cores(range(cores), router_cores) if router_cores else shared_plan(range(cores))
    cfg = ScaleConfig(load, parse_setups(setups), (64,), plan, 2, 5)
    return goal_lines(cfg, {(name, 64, "stream"): c for name, c in cells.items()})


def test_goals_compare_the_largest_worker_count_with_smg_and_with_one_process(
    bench_modules: None,
) -> None:
    cells = {
        "smg": _cell(10000, 5.0, 20.0),
        "pd-router --workers 1": _cell(3000, 1.0, 30.0),
        "pd-router --workers 6": _cell(16000, 6.0, 15.0),
    }
    lines = _goal_lines("smg,1,6", 16, 6, cells)
    assert (
        "1.60x req/s (goal >= 1.5), 0.75x CPU/request (<= 1), 0.75x p99 (<= 1): **met**"
        in (lines[0])
    )
    assert "5.33x req/s (goal >= 5.10, 0.85 x 6): **met**" in lines[1]
    assert len(lines) == 2  # the 2-core goal (one process vs smg) needs a 1-core router


def _small_box_cells(two_completed: int) -> dict:
    """smg, one process at 1.2x smg, two processes completing ``two_completed``."""
    return {
        "smg": _cell(1000, 0.5, 20.0),
        "pd-router --workers 1": _cell(1200, 0.4, 30.0),
        "pd-router --workers 2": _cell(two_completed, 0.5, 25.0),
    }


def test_on_a_one_core_router_one_process_must_lead_smg_and_two_must_not_be_slower(
    bench_modules: None,
) -> None:
    lines = _goal_lines("smg,1,2", 2, 1, _small_box_cells(1100))
    assert len(lines) == 2  # no 1.5x-smg goal: two data planes share one core
    assert lines[0].endswith("1.20x req/s (2-core goal >= 1.1): **met**")
    assert "0.92x req/s (goal >= 1.00, not slower" in lines[1] and lines[1].endswith("**not met**")


def test_on_shared_cores_one_process_must_lead_smg_and_two_must_not_be_slower(
    bench_modules: None,
) -> None:
    lines = _goal_lines("smg,1,2", 2, 0, _small_box_cells(1500))
    assert len(lines) == 2  # no 1.5x-smg goal: no core is the router's own
    assert lines[0].endswith("1.20x req/s (2-core goal >= 1.1): **met**")
    assert "1.25x req/s (goal >= 1.00, not slower: the routers share the 2 cores)" in lines[1]
    assert lines[1].endswith("**met**")


def test_a_scale_run_on_stub_workers_has_no_errors_and_writes_a_report(tmp_path: Path) -> None:
    import subprocess
    import sys

    argv = [
        sys.executable, str(BENCH / "scale.py"), "--setups", "2s", "--concurrency", "4",
        "--duration", "1", "--warmup", "0.5", "--router-cores", "1", "--backend-processes", "2",
        "--loadgens", "2", "--results-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    (report,) = tmp_path.glob("scale-*.md")
    rows = [line.split("|") for line in report.read_text().splitlines() if "pd-router" in line]
    figures = [row for row in rows if len(row) > 10 and row[1].strip() == "4"]
    assert [(row[2].strip(), row[3].strip()) for row in figures] == [
        ("non-stream", "2 pd-router processes"),
        ("stream", "2 pd-router processes"),
    ]
    assert all(row[7].strip() == "0" and int(row[4]) > 0 for row in figures)


def test_one_process_beside_busy_router_cores_runs_on_the_first_and_spins_the_rest(
    bench_modules: None,
) -> None:
    from scale import parse_setups

    (beside,) = parse_setups("1busy")
    router = (10, 11, 12)
    assert beside.name == "pd-router --workers 1, other router cores busy"
    assert (beside.cores(router), beside.spun(router), beside.multiple(router)) == (
        (10,),
        (11, 12),
        1,
    )
    assert all(setup.spun(router) == () for setup in parse_setups("smg,smg1,1,2,2s"))


def test_busy_cores_spin_for_the_block_and_stop_after_it(bench_modules: None) -> None:
    import os

    from scale import busy_cores

    core = min(os.sched_getaffinity(0))
    with busy_cores([core, core]) as spinners:
        assert len(spinners) == 2 and all(s.poll() is None for s in spinners)
    assert all(s.returncode is not None for s in spinners)


def test_goals_show_how_smg_and_one_loaded_process_scale_for_reference(
    bench_modules: None,
) -> None:
    cells = {
        "smg": _cell(12000, 6.0, 20.0),
        "smg on 1 core": _cell(2500, 1.0, 30.0),
        "pd-router --workers 1": _cell(3000, 1.0, 30.0),
        "pd-router --workers 1, other router cores busy": _cell(2500, 1.0, 30.0),
        "pd-router --workers 6": _cell(15000, 6.0, 15.0),
    }
    lines = _goal_lines("smg,smg1,1,1busy,6", 16, 6, cells)
    assert "5.00x req/s (goal >= 5.10, 0.85 x 6): **not met**" in lines[1]
    assert "vs 6 x pd-router --workers 1, other router cores busy: 1.00 (" in lines[2]
    assert "smg vs 6 x smg on 1 core: 0.80x req/s (how the peer itself scales" in lines[3]


def test_core_speed_reports_each_layout_against_one_core_alone(tmp_path: Path) -> None:
    import subprocess
    import sys

    argv = [sys.executable, str(BENCH / "core_speed.py"), "--seconds", "0.2", "--rounds", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| 1 |")]
    assert rows and rows[0][3].strip().startswith("1.00")
    assert "every core" in done.stdout
