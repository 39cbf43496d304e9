"""The pause of the background retry loops (pd_protocol.backoff)."""

from pd_protocol.backoff import Backoff


def test_pauses_double_from_the_first_up_to_the_cap():
    backoff = Backoff(0.1, 0.5)
    assert [backoff.take() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


def test_a_reset_after_a_success_starts_from_the_first_pause_again():
    backoff = Backoff(1.0, 8.0)
    backoff.take()
    backoff.take()
    backoff.reset()
    assert backoff.take() == 1.0


def test_secs_names_the_pause_the_next_sleep_takes():
    backoff = Backoff(1.0, 8.0, factor=3.0)
    backoff.take()
    assert backoff.secs == 3.0
    assert backoff.take() == 3.0
