"""How the quarantine of pairs that missed a rendezvous decides (pd_router.dataplane.routing.pairs):
pure decisions on a clock of the test's own, with workers as the legs see them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pd_router.dataplane.routing.pairs import PairQuarantine
from pd_router.roles import Role

COOLDOWN = 10.0


@dataclass(eq=False)
class Worker:
    url: str
    role: Role
    epoch: int = 0
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int | None = None
    inflight: int = 0
    circuit: object = field(default=None)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup() -> tuple[PairQuarantine, Clock, Worker, Worker, Worker]:
    clock = Clock()
    prefill = Worker("http://p", Role.PREFILL)
    decode, other = Worker("http://d1", Role.DECODE), Worker("http://d2", Role.DECODE)
    return PairQuarantine(COOLDOWN, clock), clock, prefill, decode, other


def test_a_stuck_pair_keeps_its_decode_away_from_that_prefill_only():
    pairs, _, prefill, decode, other = setup()
    pairs.stuck(prefill, decode)
    assert pairs.avoid(prefill, []) == [decode]
    assert pairs.blocks(prefill, decode) and not pairs.blocks(prefill, other)
    assert pairs.avoid(Worker("http://p2", Role.PREFILL), []) == []


def test_after_the_cooldown_one_trial_goes_through_and_a_met_one_releases_the_pair():
    pairs, clock, prefill, decode, _ = setup()
    pairs.stuck(prefill, decode)
    clock.now = COOLDOWN
    assert pairs.avoid(prefill, []) == []
    assert pairs.dispatch(prefill, decode) is True
    assert pairs.avoid(prefill, []) == [decode]  # while the trial runs
    assert pairs.dispatch(prefill, decode) is False
    pairs.met(prefill, decode)
    pairs.end_trial(prefill, decode)
    assert len(pairs) == 0


def test_a_trial_that_misses_rests_the_pair_another_cooldown():
    pairs, clock, prefill, decode, _ = setup()
    pairs.stuck(prefill, decode)
    clock.now = COOLDOWN
    assert pairs.dispatch(prefill, decode)
    pairs.stuck(prefill, decode)
    pairs.end_trial(prefill, decode)
    clock.now = 2 * COOLDOWN - 1
    assert pairs.avoid(prefill, []) == [decode]


def test_a_trial_that_ends_otherwise_leaves_the_pair_half_open():
    pairs, clock, prefill, decode, _ = setup()
    pairs.stuck(prefill, decode)
    clock.now = COOLDOWN
    assert pairs.dispatch(prefill, decode)
    pairs.end_trial(prefill, decode)
    assert pairs.avoid(prefill, []) == []
    assert pairs.dispatch(prefill, decode)


@pytest.mark.parametrize("change", ["prefill epoch", "decode role"])
def test_a_new_epoch_or_role_of_either_side_releases_the_pair(change):
    pairs, _, prefill, decode, _ = setup()
    pairs.stuck(prefill, decode)
    if change == "prefill epoch":
        prefill.epoch += 2
    else:
        decode.role = Role.PREFILL
    assert pairs.avoid(prefill, []) == []
    assert len(pairs) == 0


def test_a_worker_added_again_is_not_the_one_the_pair_failed_with():
    pairs, _, prefill, decode, _ = setup()
    pairs.stuck(prefill, decode)
    again = Worker(prefill.url, Role.PREFILL)
    assert pairs.avoid(again, []) == []
    assert len(pairs) == 0
