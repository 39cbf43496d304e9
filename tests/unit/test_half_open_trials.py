"""Which data plane may send a worker's half-open trial: one for the whole router, moved only
when its holder cannot send it, and only once the old holder can no longer have sent it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pd_router.control.trials import HalfOpenTrials, trial_plane

URL = "http://recovering"


@dataclass
class Plane:
    """A data plane as its last report shows it."""

    connections: int = 0
    acked: int = 0
    inflight: dict[str, int] = field(default_factory=dict)


@pytest.mark.parametrize(
    ("holder", "loads", "expected"),
    [
        (None, {}, None),
        (None, {0: (2, 0), 1: (5, 0), 2: (5, 0)}, 1),
        (1, {0: (2, 0), 2: (5, 0)}, 2),
        (0, {0: (0, 0), 1: (3, 0)}, 1),
        (0, {0: (0, 1), 1: (3, 0)}, 0),
        (0, {0: (1, 0), 1: (3, 0)}, 0),
        (0, {0: (0, 0), 1: (0, 0)}, 0),
    ],
    ids=[
        "no data plane",
        "the most connected takes it",
        "its holder exited",
        "its holder has no clients while another has",
        "its trial may be in flight",
        "its holder has clients",
        "nobody has clients",
    ],
)
def test_a_half_open_trial_is_held_by_one_data_plane_until_it_cannot_send_it(
    holder: int | None, loads: dict[int, tuple[int, int]], expected: int | None
):
    assert trial_plane(holder, loads) == expected


def test_the_most_connected_data_plane_gets_the_trial_when_the_circuit_opens():
    trials = HalfOpenTrials()
    assert trials.holder(URL, False, {0: Plane(1), 1: Plane(4)}, version=1) == 1


def test_a_closed_circuit_names_no_holder():
    trials = HalfOpenTrials()
    trials.holder(URL, False, {0: Plane(1)}, version=1)
    assert trials.holder(URL, True, {0: Plane(1)}, version=2) is None
    assert not trials.unsettled({0: Plane(1)})


def test_a_trial_moves_only_once_its_old_holder_acked_and_has_nothing_in_flight():
    trials = HalfOpenTrials()
    planes = {0: Plane(2), 1: Plane(1)}
    assert trials.holder(URL, False, planes, version=1) == 0
    planes[0].connections, planes[1].connections = 0, 3
    assert trials.unsettled(planes)
    assert trials.holder(URL, False, planes, version=2) is None  # taken from 0, nobody yet
    planes[0].acked = 1
    assert not trials.unsettled(planes)
    assert trials.holder(URL, False, planes, version=3) is None
    planes[0].acked, planes[0].inflight = 2, {URL: 1}  # it sent the trial before it heard
    assert not trials.unsettled(planes)
    planes[0].inflight = {}
    assert trials.unsettled(planes)
    assert trials.holder(URL, False, planes, version=4) == 1


def test_the_trial_of_a_holder_that_exited_goes_to_another_at_once():
    trials = HalfOpenTrials()
    planes = {0: Plane(2), 1: Plane(1)}
    assert trials.holder(URL, False, planes, version=1) == 0
    del planes[0]
    assert trials.holder(URL, False, planes, version=2) == 1


def test_a_trial_named_while_no_data_plane_was_connected_goes_to_the_first_one():
    trials = HalfOpenTrials()
    assert trials.holder(URL, False, {}, version=1) is None
    assert trials.unsettled({3: Plane(0)})
    assert trials.holder(URL, False, {3: Plane(0)}, version=2) == 3
