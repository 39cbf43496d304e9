"""What a worker's error answer means for the retry: which pair it leaves."""

from __future__ import annotations

from types import SimpleNamespace

from pd_router.dataplane.legs.leg import LegResult, status_failure
from pd_router.roles import Role

WORKER = SimpleNamespace(url="http://127.0.0.1:1")
LOST_PREFILL = (
    b'{"object":"error","message":"Decode transfer failed for request rank=0 with exception '
    b"KVTransferError(bootstrap_room=7): Lost connection with prefill instance "
    b'(bootstrap_addr: 127.0.0.1:2)","code":500}'
)


def test_a_decode_that_lost_its_prefill_is_retried_away_from_that_prefill():
    failure = status_failure(Role.DECODE, WORKER, LegResult(500, LOST_PREFILL, "application/json"))
    assert failure.retryable
    assert failure.handoff_failed


def test_a_decode_failing_for_another_reason_blames_only_itself():
    failure = status_failure(Role.DECODE, WORKER, LegResult(500, b"out of memory", "text/plain"))
    assert not failure.retryable
    assert not failure.handoff_failed


def test_a_prefill_failure_is_not_a_hand_off_failed_at_the_decode():
    failure = status_failure(Role.PREFILL, WORKER, LegResult(500, LOST_PREFILL, "text/plain"))
    assert failure.retryable
    assert not failure.handoff_failed
