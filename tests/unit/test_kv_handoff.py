"""The torch prefill's room payload and how a decode pairs the prefill's byte runs with its own
slots' runs (pure logic, no processes)."""

from __future__ import annotations

import pytest

from pd_worker.kv_handoff import BadHandoff, KVHandoff, pair_runs


def test_runs_fragmented_differently_on_each_side_pair_into_transfers_contiguous_on_both():
    remote = [(0, 30), (100, 10)]
    local = [(50, 10), (200, 30)]
    assert pair_runs(remote, local) == [(0, 50, 10), (10, 200, 20), (100, 220, 10)]


def test_identical_runs_pair_one_to_one():
    assert pair_runs([(0, 8), (32, 8)], [(64, 8), (96, 8)]) == [(0, 64, 8), (32, 96, 8)]


def test_runs_of_different_total_size_are_refused():
    with pytest.raises(BadHandoff):
        pair_runs([(0, 16)], [(0, 8)])


def test_a_handoff_survives_the_room_payload_round_trip():
    handoff = KVHandoff("tcp", "127.0.0.1:4000", 140000000, [(0, 2048), (8192, 4096)], 171, 3)
    assert KVHandoff.decode(handoff.encode()) == handoff


def test_a_payload_that_is_not_a_handoff_is_refused():
    with pytest.raises(BadHandoff):
        KVHandoff.decode(b"\x01\x00\x00\x00")
