"""The switch loop both control protocols share (pd_router/control/conversion/protocols.py,
ControlProtocol.switch_until_idle), on a stepped clock: which refusals are called again, and
when a refusal is taken as the answer."""

from __future__ import annotations

import pytest

from pd_protocol.wire import CONVERT_PATH, SWITCH_PATH
from pd_router.control.conversion.history import Conversion, ConversionRequest, Status
from pd_router.control.conversion.protocols import (
    IDLE_AGREEMENT_SECS,
    ExtensionProtocol,
    NativeProtocol,
    Stop,
    protocol_for,
)
from pd_router.control.worker_control import ControlError, SwitchReply
from pd_router.control.workers import WorkerRegistry
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from tests.unit.clock import FakeClock
from tests.unit.fake_control import OK_SWITCH, FakeWorker, FakeWorkerControl

BODY = {"new_role": "decode"}
SAFE = SwitchReply(400, {"success": False, "safe_to_restore": True, "message": "no"})
UNSAFE = SwitchReply(400, {"success": False, "safe_to_restore": False, "message": "bad"})
NOT_IDLE = SwitchReply(400, {"success": False, "safe_to_restore": True, "message": "not idle"})


class Setup:
    """One prefill behind a fake control, a conversion of it to decode, and a protocol over
    a clock that moves ``step`` seconds on each read."""

    def __init__(self, *, extensions: bool = False, drain: bool = True, step: float = 0.0):
        registry = WorkerRegistry(RouterMetrics())
        self.worker = registry.add("http://10.0.0.1:30000", Role.PREFILL, 8998)
        self.control = FakeWorkerControl(registry)
        self.model: FakeWorker = self.control.add(self.worker, extensions=extensions)
        self.clock = FakeClock(step=step)
        self.protocol = protocol_for(self.control, extensions, self.clock)  # type: ignore[arg-type]
        self.conversion = Conversion(
            id="c1",
            worker=self.worker,
            from_role=Role.PREFILL,
            to_role=Role.DECODE,
            request=ConversionRequest(worker=self.worker.url, drain=drain),
            protocol=self.protocol.name,
        )

    async def switch(self, deadline_in: float = 300.0):
        deadline = self.clock.now + deadline_in
        return await self.protocol.switch_until_idle(self.conversion, dict(BODY), deadline)

    def switch_calls(self) -> int:
        return self.control.called(self.worker.url, SWITCH_PATH) + self.control.called(
            self.worker.url, CONVERT_PATH
        )


def test_the_protocol_follows_the_worker():
    assert isinstance(protocol_for(None, True), ExtensionProtocol)  # type: ignore[arg-type]
    assert isinstance(protocol_for(None, False), NativeProtocol)  # type: ignore[arg-type]


async def test_a_switch_that_succeeds_at_once_is_called_once():
    s = Setup()
    reply, busy = await s.switch()
    assert (reply, busy, s.switch_calls()) == (OK_SWITCH, None, 1)


async def test_a_refusal_without_safe_to_restore_is_the_answer_at_once():
    s = Setup()
    s.model.switch_replies.append(UNSAFE)
    reply, busy = await s.switch()
    assert (reply, busy, s.switch_calls()) == (UNSAFE, None, 1)


async def test_without_a_drain_a_safe_refusal_is_the_answer_at_once():
    s = Setup(drain=False)
    s.model.switch_replies.append(SAFE)
    reply, _ = await s.switch()
    assert (reply, s.switch_calls()) == (SAFE, 1)


async def test_a_safe_refusal_from_a_busy_worker_is_called_again_until_it_switches():
    s = Setup()
    s.model.running = 2
    s.model.switch_replies.extend([SAFE, SAFE])
    reply, busy = await s.switch()
    assert (reply, busy, s.switch_calls()) == (OK_SWITCH, None, 3)


async def test_a_busy_worker_at_the_deadline_is_returned_with_its_load():
    s = Setup(step=1.0)
    s.model.running = 2
    s.model.switch_replies.extend([SAFE] * 10)
    reply, busy = await s.switch(deadline_in=3.0)
    assert reply == SAFE
    assert busy is not None and busy.num_running == 2
    assert s.switch_calls() < 10


async def test_a_safe_refusal_while_the_load_reads_idle_is_taken_once_they_disagree_long_enough():
    s = Setup(step=IDLE_AGREEMENT_SECS / 2)
    s.model.switch_replies.extend([SAFE] * 10)
    reply, busy = await s.switch()
    assert (reply, busy) == (SAFE, None)
    assert 2 <= s.switch_calls() <= 4


async def test_a_safe_refusal_while_the_load_reads_idle_is_called_again_within_the_agreement():
    s = Setup(step=0.0)
    s.model.switch_replies.extend([SAFE, SAFE])
    reply, _ = await s.switch()
    assert (reply, s.switch_calls()) == (OK_SWITCH, 3)


async def test_a_not_idle_refusal_is_called_again_past_the_agreement_while_the_load_reads_idle():
    s = Setup(step=IDLE_AGREEMENT_SECS)
    s.model.switch_replies.extend([NOT_IDLE] * 4)
    reply, _ = await s.switch()
    assert (reply, s.switch_calls()) == (OK_SWITCH, 5)


async def test_a_not_idle_refusal_at_the_deadline_is_returned_with_the_load():
    s = Setup(step=1.0)
    s.model.switch_replies.extend([NOT_IDLE] * 10)
    reply, busy = await s.switch(deadline_in=2.0)
    assert reply == NOT_IDLE and busy is not None and busy.idle


async def test_a_refusal_in_front_of_the_handler_is_the_answer_at_once():
    s = Setup()
    refused = SwitchReply(403, {"error": "forbidden"})
    s.model.switch_replies.append(refused)
    reply, _ = await s.switch()
    assert (reply, s.switch_calls()) == (refused, 1)


async def test_every_call_is_kept_on_the_record_with_the_time_spent_in_the_worker():
    s = Setup()
    s.model.running = 1
    s.model.switch_replies.append(SAFE)
    await s.switch()
    assert [r["status"] for r in s.conversion.worker_replies] == [400, 200]
    assert s.conversion.timings["worker_switch_s"] >= 0
    assert s.conversion.progress["worker_running"] == 1


async def test_a_switch_call_that_could_not_connect_puts_the_worker_back_unhealthy():
    s = Setup()
    s.model.switch_replies.append(
        ControlError(s.worker.url, SWITCH_PATH, "refused", delivered=False)
    )
    with pytest.raises(Stop) as stop:
        await s.switch()
    assert (stop.value.status, stop.value.restore, stop.value.healthy) == (
        Status.RESTORED, True, False,
    )  # fmt: skip


async def test_a_switch_call_unanswered_by_a_worker_that_still_answers_leaves_its_role_unknown():
    s = Setup()
    s.model.switch_replies.append(ControlError(s.worker.url, SWITCH_PATH, "timed out"))
    with pytest.raises(Stop) as stop:
        await s.switch()
    assert (stop.value.status, stop.value.restore) == (Status.FAILED, False)


async def test_a_load_that_cannot_be_read_puts_the_worker_back_unhealthy():
    s = Setup()
    s.model.switch_replies.append(SAFE)

    async def gone(worker):
        raise ControlError(worker.url, "/v1/loads", "refused", delivered=False)

    s.control.read_load = gone  # type: ignore[method-assign]
    with pytest.raises(Stop) as stop:
        await s.switch()
    assert (stop.value.status, stop.value.healthy) == (Status.RESTORED, False)


def test_the_extension_tells_the_worker_how_long_its_drain_may_take():
    s = Setup(extensions=True)
    fields = s.protocol.switch_fields(s.conversion, s.clock.now + 12.5)
    assert fields == {"drain_timeout_secs": 12.5}


def test_the_extension_passes_no_drain_time_without_a_drain():
    s = Setup(extensions=True, drain=False)
    assert s.protocol.switch_fields(s.conversion, s.clock.now + 12.5) == {}


async def test_the_extension_converts_on_the_worker_when_draining_and_switches_when_not():
    drained = Setup(extensions=True)
    await drained.switch()
    assert drained.control.called(drained.worker.url, CONVERT_PATH) == 1
    plain = Setup(extensions=True, drain=False)
    await plain.switch()
    assert plain.control.called(plain.worker.url, SWITCH_PATH) == 1


async def test_the_extension_reopens_admission_only_after_a_refused_conversion():
    s = Setup(extensions=True)
    await s.protocol.close_admission(s.conversion)
    assert not s.model.admitting and s.conversion.admission_closed
    s.model.switch_replies.append(UNSAFE)
    await s.switch()
    assert s.conversion.admission_closed
    await s.protocol.reopen_admission(s.conversion)
    assert s.model.admitting and not s.conversion.admission_closed


async def test_an_extension_worker_refusing_to_close_admission_goes_back_healthy():
    s = Setup(extensions=True)

    async def refuse(worker, *, open_):
        raise ControlError(worker.url, "/pd_drain", "HTTP 500", status=500)

    s.control.set_admission = refuse  # type: ignore[method-assign]
    with pytest.raises(Stop) as stop:
        await s.protocol.close_admission(s.conversion)
    assert (stop.value.status, stop.value.restore, stop.value.healthy) == (
        Status.RESTORED, True, True,
    )  # fmt: skip


async def test_the_native_protocol_has_no_admission_to_close():
    s = Setup()
    await s.protocol.close_admission(s.conversion)
    await s.protocol.reopen_admission(s.conversion)
    assert s.control.calls == []
