"""How ``/get_loads`` reads a worker's load from recorded answers of SGLang's ``/get_load`` (one
entry per DP rank) and ``/v1/loads``: tokens summed over the ranks, -1 for an answer that
reports none."""

from __future__ import annotations

import orjson

from pd_router.api.loads import NO_LOAD, get_load_tokens, v1_loads_tokens

GET_LOAD_TWO_RANKS = orjson.dumps(
    [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 1200},
        {"dp_rank": 1, "num_reqs": 2, "num_waiting_reqs": 0, "num_tokens": 800},
    ]
)
V1_LOADS_TWO_RANKS = orjson.dumps(
    {
        "version": "0.5.23",
        "dp_rank_count": 2,
        "loads": [
            {"dp_rank": 0, "num_used_tokens": 500, "num_total_tokens": 500},
            {"dp_rank": 1, "num_used_tokens": 250, "num_total_tokens": 250},
        ],
        "aggregate": {"total_running_reqs": 4},
    }
)


def test_get_load_sums_the_tokens_of_every_dp_rank():
    assert get_load_tokens(GET_LOAD_TWO_RANKS) == 2000


def test_v1_loads_sums_the_total_tokens_of_every_dp_rank():
    assert v1_loads_tokens(V1_LOADS_TWO_RANKS) == 750


def test_an_idle_worker_has_load_zero_not_minus_one():
    assert get_load_tokens(b'[{"dp_rank": 0, "num_reqs": 0, "num_tokens": 0}]') == 0


def test_an_answer_without_token_counts_is_minus_one():
    assert get_load_tokens(b"not json") == NO_LOAD
    assert get_load_tokens(b'{"load": 3}') == NO_LOAD
    assert get_load_tokens(b'[{"dp_rank": 0}]') == NO_LOAD
    assert v1_loads_tokens(b'{"loads": []}') == NO_LOAD
    assert v1_loads_tokens(GET_LOAD_TWO_RANKS) == NO_LOAD
