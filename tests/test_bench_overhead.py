"""The router-overhead benchmark's harness keeps working: its helpers compute what they claim,
and a tiny end-to-end run (pd-router in front of stub workers) completes without errors and
writes its report. No timing is asserted: figures belong in docs/PERFORMANCE.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def bench_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/ is a folder of scripts, not a package: make its modules importable."""
    monkeypatch.syspath_prepend(str(BENCH))


def test_percentile_is_nearest_rank(bench_modules: None) -> None:
    from overhead import percentile

    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )


def test_percentile_of_nothing_is_nan(bench_modules: None) -> None:
    from overhead import percentile

    assert percentile([], 50) != percentile([], 50)


CHILD = (
    "import os, sys, time\n"
    "end = time.process_time() + 0.3\n"
    "while time.process_time() < end:\n"
    "    pass\n"
    "print(os.getpid(), flush=True)\n"
    "sys.stdin.read()\n"
)


def test_process_tree_cpu_includes_a_busy_child(bench_modules: None) -> None:
    from proc_cpu import process_tree, tree_cpu_seconds

    spawn_child = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdin=subprocess.PIPE).wait()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn_child], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        assert child_pid in process_tree(parent.pid)
        assert tree_cpu_seconds(parent.pid) >= 0.25
    finally:
        parent.kill()
        parent.wait(timeout=10)


def test_profile_summary_leaves_out_syscalls_and_charges_python_frames(
    bench_modules: None, tmp_path: Path
) -> None:
    from profile_summary import summarize

    raw = tmp_path / "profile.txt"
    raw.write_text(
        "main (/r/pd_router/cli/main.py:1);serve (/r/pd_router/dataplane/path/proxy.py:70);"
        "epoll_pwait (libc.so.6) 5\n"
        "main (/r/pd_router/cli/main.py:1);serve (/r/pd_router/dataplane/path/proxy.py:70);"
        "feed_data (_http_parser.c:9) 3\n"
        "main (/r/pd_router/cli/main.py:1);gc_collect_main (libpython3.11.so.1.0) 2\n"
    )
    summary = summarize(raw)
    assert (summary.total, summary.user, summary.in_syscalls["epoll_pwait"]) == (10, 5, 5)
    assert summary.self_samples["serve (pd_router/dataplane/path/proxy.py)"] == 3
    assert summary.self_samples["gc_collect_main (cyclic GC)"] == 2
    assert summary.inclusive_samples["main (pd_router/cli/main.py)"] == 5


def test_overhead_run_on_stub_workers_has_no_errors_and_writes_a_report(tmp_path: Path) -> None:
    argv = [
        sys.executable, str(BENCH / "overhead.py"), "--peers", "pd-router", "--backend", "stub",
        "--duration", "1", "--warmup", "0.5", "--rounds", "1", "--concurrency", "4",
        "--results-dir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = list(tmp_path.glob("overhead-*.md"))
    assert len(reports) == 1
    rows = [line for line in reports[0].read_text().splitlines() if "| pd-router |" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["non-stream", "stream"]
    assert all(row.split("|")[6].strip() == "0" for row in rows)
