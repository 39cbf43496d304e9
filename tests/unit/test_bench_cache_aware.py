"""The cache-aware benchmark's workload and bookkeeping: groups share exactly their system
prompt, the order is seeded, and a worker counter is read from its /metrics text. Pure
functions, no processes; the figures themselves belong in docs/PERFORMANCE.md."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def ca(monkeypatch: pytest.MonkeyPatch):
    """bench/ is a folder of scripts, not a package: import cache_aware.py from it."""
    monkeypatch.syspath_prepend(str(BENCH))
    import cache_aware

    return cache_aware


def config(ca, seed: int = 5):
    return ca.parse_args(
        ["--groups", "3", "--prompts-per-group", "4", "--system-len", "50",
         "--question-len", "10", "--seed", str(seed)]
    )  # fmt: skip


def test_each_group_shares_its_system_prompt_and_nothing_more(ca) -> None:
    prompts = ca.workload(config(ca))
    assert len(prompts) == 12
    assert {len(p) for p in prompts} == {60}
    assert sorted(Counter(p[:50] for p in prompts).values()) == [4, 4, 4]
    assert len({p[50:] for p in prompts}) == 12


def test_the_same_seed_sends_the_same_prompts_in_the_same_order(ca) -> None:
    assert ca.workload(config(ca)) == ca.workload(config(ca))
    assert ca.workload(config(ca)) != ca.workload(config(ca, seed=6))


def test_a_worker_counter_is_read_from_its_metrics_text(ca) -> None:
    text = (
        "# TYPE sglang:cached_tokens_total counter\n"
        'sglang:cached_tokens_total{model_name="m",engine_type="unified"} 4096.0\n'
        'sglang:prompt_tokens_total{model_name="m",engine_type="unified"} 8192.0\n'
    )
    assert ca.counter(text, "cached_tokens") == 4096.0
    assert ca.counter(text, "prompt_tokens") == 8192.0
    with pytest.raises(ValueError):
        ca.counter(text, "generation_tokens")
