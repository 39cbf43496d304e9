"""Every way a conversion ends (pd_router/control/conversion/), run by the real
ConversionManager against a worker control with no network (tests/unit/fake_control.py) and a
router alone (LocalCluster): where the worker goes, what the record says, what was called."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pd_protocol.wire import CONVERT_PATH, DRAIN_PATH, SWITCH_PATH
from pd_router.control.cluster.local import LocalCluster
from pd_router.control.conversion.history import Conversion, ConversionRequest, Status
from pd_router.control.conversion.manager import (
    ConversionManager,
    ConversionRefused,
    KnobNotAccepted,
    WorkerUnreachable,
)
from pd_router.control.worker_control import ControlError, SwitchReply
from pd_router.control.workers import Worker, WorkerRegistry, WorkerState
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role
from tests.unit.clock import FakeClock
from tests.unit.fake_control import OK_SWITCH, FakeWorker, FakeWorkerControl

WAIT = 5.0
# Refused before any switch began (the worker names the field it refused): not called again.
REFUSED_SAFE = SwitchReply(
    400, {"success": False, "safe_to_restore": True, "message": "no", "field": "new_role"}
)
REFUSED_UNSAFE = SwitchReply(400, {"success": False, "safe_to_restore": False, "message": "bad"})
# Refused with the worker's load reading idle: called again until they disagree long enough.
REFUSED_IDLE = SwitchReply(400, {"success": False, "safe_to_restore": True, "message": "no"})
NOT_IDLE = SwitchReply(
    400, {"success": False, "safe_to_restore": True, "message": "instance is not idle"}
)


class Fleet:
    """Two prefills and a decode in a registry, a fake control for each, and the manager."""

    def __init__(self, *, extensions: bool = False, **manager: object) -> None:
        self.metrics = RouterMetrics()
        self.registry = WorkerRegistry(self.metrics)
        self.control = FakeWorkerControl(self.registry)
        self.reported_down: list[tuple[Worker, str]] = []
        self.p0 = self.registry.add("http://10.0.0.1:30000", Role.PREFILL, 8998)
        self.p1 = self.registry.add("http://10.0.0.2:30000", Role.PREFILL, 8998)
        self.d0 = self.registry.add("http://10.0.0.3:30000", Role.DECODE)
        self.models = {w: self.control.add(w, extensions=extensions) for w in self.registry}
        self.manager = ConversionManager(
            self.registry,
            self.metrics,
            self.control,  # type: ignore[arg-type]
            lambda worker, why: self.reported_down.append((worker, why)),
            cluster=LocalCluster(self.registry),
            **manager,  # type: ignore[arg-type]
        )

    def model(self, worker: Worker) -> FakeWorker:
        return self.models[worker]

    async def start(self, worker: Worker, **request: object) -> Conversion:
        return await self.manager.start(ConversionRequest(worker=worker.url, **request))  # type: ignore[arg-type]

    async def run(self, worker: Worker, **request: object) -> Conversion:
        conversion = await self.start(worker, **request)
        await asyncio.wait_for(conversion.wait(), WAIT)
        return conversion

    async def gone_while_switching(self, worker: Worker) -> Conversion:
        """Run a conversion of ``worker`` whose process goes while the switch call is out: the
        call then answers what ``switch_replies`` says, and nothing after it connects."""
        release = asyncio.Event()
        model = self.model(worker)
        model.hold_switch = release
        conversion = await self.start(worker)
        await asyncio.wait_for(self.control.switch_sent.wait(), WAIT)
        model.gone = True
        release.set()
        await asyncio.wait_for(conversion.wait(), WAIT)
        return conversion

    def counted(self, status: Status, from_role: Role = Role.PREFILL) -> float:
        return self.metrics.registry.get_sample_value(
            "pd_router_conversions_total",
            {"from_role": from_role.value, "to_role": from_role.other.value, "outcome": status},
        )


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet()
    yield fleet
    await fleet.manager.close()


@pytest.fixture
async def ext_fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet(extensions=True)
    yield fleet
    await fleet.manager.close()


async def draining(conversion: Conversion) -> None:
    """One step of the loop: the conversion's task runs to its wait for the last request."""
    await asyncio.sleep(0)
    assert "router_inflight_at_start" in conversion.progress


def back_in_old_pool(worker: Worker, role: Role = Role.PREFILL) -> bool:
    return (worker.state, worker.role, worker.epoch, worker.conversion_id) == (
        WorkerState.ACTIVE, role, 0, None,
    )  # fmt: skip


# --- success ----------------------------------------------------------------------------------


async def test_a_native_conversion_switches_verifies_and_re_registers_in_the_new_role(fleet):
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.SUCCEEDED, conversion.message
    assert (fleet.p0.state, fleet.p0.role, fleet.p0.epoch) == (WorkerState.ACTIVE, Role.DECODE, 1)
    assert conversion.epoch == 1
    assert fleet.registry.in_role(Role.DECODE) == [fleet.p0, fleet.d0]
    assert fleet.counted(Status.SUCCEEDED) == 1


async def test_a_switch_to_decode_carries_a_decode_peers_graph_parameters(fleet):
    await fleet.run(fleet.p0)
    assert fleet.control.switch_bodies == [
        {"new_role": "decode", "decode_cuda_graph_bs": [1, 2], "decode_cuda_graph_memory_gb": 1.5}
    ]


async def test_the_callers_graph_parameters_win_over_the_peers(fleet):
    await fleet.run(fleet.p0, decode_cuda_graph_bs=[8], decode_cuda_graph_memory_gb=3.0)
    assert fleet.control.switch_bodies[0]["decode_cuda_graph_bs"] == [8]
    assert fleet.control.switch_bodies[0]["decode_cuda_graph_memory_gb"] == 3.0


async def test_a_canary_meets_a_peer_of_the_other_role_before_clients_get_the_worker(fleet):
    conversion = await fleet.run(fleet.p0)
    canary = [r for r in conversion.worker_replies if r["call"] == "canary"]
    assert canary[0]["status"] == 200 and canary[0]["body"]["peer"] == fleet.p1.url


async def test_a_conversion_to_prefill_has_the_decodes_forget_its_old_endpoints(fleet):
    fleet.registry.add("http://10.0.0.4:30000", Role.DECODE)
    fleet.control.add(fleet.registry.get("http://10.0.0.4:30000"))
    conversion = await fleet.run(fleet.d0)
    assert conversion.status is Status.SUCCEEDED, conversion.message
    assert fleet.control.forgotten == [(fleet.d0.url, None)]
    assert fleet.d0.role is Role.PREFILL


async def test_an_extension_conversion_closes_admission_then_converts_on_the_worker(ext_fleet):
    conversion = await ext_fleet.run(ext_fleet.p0)
    assert conversion.status is Status.SUCCEEDED, conversion.message
    calls = [path for url, path in ext_fleet.control.calls if url == ext_fleet.p0.url]
    assert calls.index(DRAIN_PATH) < calls.index(CONVERT_PATH)
    assert "drain_timeout_secs" in ext_fleet.control.switch_bodies[0]
    assert ext_fleet.model(ext_fleet.p0).admitting


async def test_an_extension_conversion_without_drain_calls_the_plain_switch(ext_fleet):
    conversion = await ext_fleet.run(ext_fleet.p0, drain=False)
    assert conversion.status is Status.SUCCEEDED, conversion.message
    assert ext_fleet.control.called(ext_fleet.p0.url, SWITCH_PATH) == 1
    assert ext_fleet.control.called(ext_fleet.p0.url, CONVERT_PATH) == 0


# --- refused before anything changed ----------------------------------------------------------


async def refusal(fleet: Fleet, worker: Worker | str, **request: object) -> str:
    url = worker if isinstance(worker, str) else worker.url
    with pytest.raises(ConversionRefused) as refused:
        await fleet.manager.start(ConversionRequest(worker=url, **request))  # type: ignore[arg-type]
    return refused.value.reason


async def test_an_unknown_worker_is_refused(fleet):
    assert await refusal(fleet, "http://10.9.9.9:1") == "unknown_worker"


async def test_a_conversion_to_the_role_the_worker_has_is_refused(fleet):
    assert await refusal(fleet, fleet.p0, new_role=Role.PREFILL) == "already_in_role"
    assert back_in_old_pool(fleet.p0)


async def test_a_conversion_that_would_empty_a_pool_below_its_minimum_is_refused(fleet):
    assert await refusal(fleet, fleet.d0) == "min_decode"
    assert back_in_old_pool(fleet.d0, Role.DECODE)


async def test_a_worker_that_cannot_switch_is_refused(fleet):
    fleet.registry.set_switch_supported(fleet.p0, False)
    assert await refusal(fleet, fleet.p0) == "switch_not_supported"


async def test_a_second_conversion_over_the_cap_is_refused(fleet):
    fleet.registry.set_inflight(fleet.p0, 1, 0.0)
    first = await fleet.start(fleet.p0)
    assert await refusal(fleet, fleet.p1) == "too_many_conversions"
    assert back_in_old_pool(fleet.p1)
    fleet.manager.abort(first.id)
    await asyncio.wait_for(first.wait(), WAIT)


async def test_a_worker_being_removed_is_refused(fleet):
    fleet.registry.begin_removal(fleet.p0)
    assert await refusal(fleet, fleet.p0) == "removing"


async def test_a_worker_that_cannot_be_reached_is_refused_with_nothing_changed(fleet):
    fleet.model(fleet.p0).gone = True
    with pytest.raises(WorkerUnreachable):
        await fleet.start(fleet.p0)
    assert back_in_old_pool(fleet.p0)


async def test_a_knob_for_a_native_worker_is_refused(fleet):
    with pytest.raises(KnobNotAccepted) as refused:
        await fleet.start(fleet.p0, extra={"drain_poll_secs": 1})
    assert refused.value.field == "drain_poll_secs"
    assert back_in_old_pool(fleet.p0)


# --- the switch refused -----------------------------------------------------------------------


async def test_a_switch_refused_as_safe_to_restore_puts_the_worker_back(fleet):
    fleet.model(fleet.p0).switch_replies.append(REFUSED_SAFE)
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.RESTORED
    assert "worker unchanged" in conversion.message
    assert back_in_old_pool(fleet.p0)
    assert fleet.counted(Status.RESTORED) == 1


async def test_a_switch_refused_without_safe_to_restore_fails_the_worker(fleet):
    fleet.model(fleet.p0).switch_replies.append(REFUSED_UNSAFE)
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.FAILED
    assert fleet.p0.state is WorkerState.FAILED
    assert "without safe_to_restore" in fleet.p0.last_error
    assert fleet.registry.in_role(Role.PREFILL, [WorkerState.ACTIVE]) == [fleet.p1]


async def test_a_refusal_in_front_of_the_switch_handler_changed_nothing(fleet):
    fleet.model(fleet.p0).switch_replies.append(SwitchReply(401, {"error": "unauthorized"}))
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.RESTORED
    assert back_in_old_pool(fleet.p0)


async def test_an_extension_refusal_reopens_the_workers_admission(ext_fleet):
    ext_fleet.model(ext_fleet.p0).switch_replies.append(REFUSED_SAFE)
    conversion = await ext_fleet.run(ext_fleet.p0)
    assert conversion.status is Status.RESTORED
    assert ext_fleet.model(ext_fleet.p0).admitting


# --- drain timeout ----------------------------------------------------------------------------


async def test_requests_still_in_flight_at_the_deadline_end_it_as_a_drain_timeout(fleet):
    fleet.registry.set_inflight(fleet.p0, 2, 0.0)
    conversion = await fleet.run(fleet.p0, drain_timeout_secs=0.0)
    assert conversion.status is Status.DRAIN_TIMEOUT
    assert "2 request(s) still in flight" in conversion.message
    assert fleet.control.called(fleet.p0.url, SWITCH_PATH) == 0
    assert back_in_old_pool(fleet.p0)


async def test_a_worker_still_busy_at_the_deadline_ends_it_as_a_drain_timeout(fleet):
    model = fleet.model(fleet.p0)
    model.running = 3
    model.switch_replies.append(NOT_IDLE)
    conversion = await fleet.run(fleet.p0, drain_timeout_secs=0.0)
    assert conversion.status is Status.DRAIN_TIMEOUT
    assert "3 running" in conversion.message
    assert back_in_old_pool(fleet.p0)


async def test_a_not_idle_refusal_is_called_again_until_the_worker_switches(fleet):
    fleet.model(fleet.p0).switch_replies.extend([NOT_IDLE, NOT_IDLE])
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.SUCCEEDED, conversion.message
    assert fleet.control.called(fleet.p0.url, SWITCH_PATH) == 3


async def test_the_drain_waits_for_the_last_request_then_switches(fleet):
    fleet.registry.set_inflight(fleet.p0, 1, 0.0)
    conversion = await fleet.start(fleet.p0)
    await draining(conversion)
    assert not fleet.control.switch_sent.is_set()
    fleet.registry.set_inflight(fleet.p0, 0, 1.0)
    await asyncio.wait_for(conversion.wait(), WAIT)
    assert conversion.status is Status.SUCCEEDED, conversion.message


# --- aborts -----------------------------------------------------------------------------------


async def test_an_abort_while_draining_puts_the_worker_back_without_a_switch(ext_fleet):
    ext_fleet.registry.set_inflight(ext_fleet.p0, 1, 0.0)
    conversion = await ext_fleet.start(ext_fleet.p0)
    ext_fleet.manager.abort(conversion.id)
    await asyncio.wait_for(conversion.wait(), WAIT)
    assert conversion.status is Status.ABORTED
    assert "by the operator" in conversion.message
    assert ext_fleet.control.called(ext_fleet.p0.url, CONVERT_PATH) == 0
    assert back_in_old_pool(ext_fleet.p0)
    assert ext_fleet.model(ext_fleet.p0).admitting


async def test_an_abort_after_the_switch_call_went_out_is_refused_and_the_switch_ends(fleet):
    release = asyncio.Event()
    fleet.model(fleet.p0).hold_switch = release
    conversion = await fleet.start(fleet.p0)
    await asyncio.wait_for(fleet.control.switch_sent.wait(), WAIT)
    with pytest.raises(ConversionRefused) as refused:
        fleet.manager.abort(conversion.id)
    assert refused.value.reason == "not_abortable"
    release.set()
    await asyncio.wait_for(conversion.wait(), WAIT)
    assert conversion.status is Status.SUCCEEDED


async def test_a_worker_leaving_during_the_drain_aborts_its_conversion(fleet):
    fleet.registry.set_inflight(fleet.p0, 1, 0.0)
    conversion = await fleet.start(fleet.p0)
    assert await asyncio.wait_for(fleet.manager.let_go(fleet.p0), WAIT)
    assert conversion.status is Status.ABORTED
    assert "leaving" in conversion.message


async def test_a_router_shutdown_aborts_a_draining_conversion(fleet):
    fleet.registry.set_inflight(fleet.p0, 1, 0.0)
    conversion = await fleet.start(fleet.p0)
    await draining(conversion)
    await fleet.manager.close()
    assert conversion.status is Status.ABORTED
    assert back_in_old_pool(fleet.p0)


async def test_a_router_shutdown_right_after_the_start_aborts_the_conversion_it_just_claimed(fleet):
    fleet.registry.set_inflight(fleet.p0, 1, 0.0)
    conversion = await fleet.start(fleet.p0)
    await fleet.manager.close()
    assert conversion.status is Status.ABORTED
    assert back_in_old_pool(fleet.p0)


async def test_a_router_shutdown_with_the_switch_unanswered_leaves_the_role_unknown(fleet):
    fleet.model(fleet.p0).hold_switch = asyncio.Event()
    conversion = await fleet.start(fleet.p0)
    await asyncio.wait_for(fleet.control.switch_sent.wait(), WAIT)
    await fleet.manager.close()
    assert conversion.status is Status.FAILED
    assert "role is unknown" in conversion.message
    assert fleet.p0.state is WorkerState.FAILED


async def test_a_finished_conversion_cannot_be_aborted(fleet):
    conversion = await fleet.run(fleet.p0)
    with pytest.raises(ConversionRefused) as refused:
        fleet.manager.abort(conversion.id)
    assert refused.value.reason == "not_abortable"


# --- verify and canary ------------------------------------------------------------------------


async def test_a_worker_reporting_another_role_after_its_switch_fails(fleet):
    fleet.model(fleet.p0).role_after_switch = Role.PREFILL
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.FAILED
    assert "reports prefill" in conversion.message
    assert fleet.p0.state is WorkerState.FAILED


async def test_a_role_that_cannot_be_read_back_fails_the_worker(fleet):
    conversion = await fleet.gone_while_switching(fleet.p0)
    assert conversion.status is Status.FAILED
    assert "could not read the role back" in conversion.message


async def test_a_failed_canary_switches_the_worker_back_to_its_old_role(fleet):
    fleet.model(fleet.p0).canary = (500, {"error": "KV transfer failed"})
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.RESTORED
    assert "canary failed" in conversion.message
    assert [b["new_role"] for b in fleet.control.switch_bodies] == ["decode", "prefill"]
    assert back_in_old_pool(fleet.p0)
    assert fleet.control.forgotten == [(fleet.p0.url, 8998)]


async def test_a_failed_canary_whose_switch_back_fails_leaves_the_worker_failed(fleet):
    model = fleet.model(fleet.p0)
    model.canary = (500, {})
    model.switch_replies.extend([OK_SWITCH, REFUSED_UNSAFE])
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.FAILED
    assert "did not take" in conversion.message
    assert fleet.p0.state is WorkerState.FAILED


async def test_an_aborted_canary_answer_is_a_failure(fleet):
    fleet.model(fleet.p0).canary = (
        200, {"meta_info": {"finish_reason": {"type": "abort", "message": "stale"}}},
    )  # fmt: skip
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.RESTORED
    assert "aborted: stale" in conversion.message


async def test_without_a_canary_timeout_no_canary_runs():
    fleet = Fleet(canary_timeout_secs=0)
    fleet.model(fleet.p0).canary = (500, {})
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.SUCCEEDED


# --- the worker gone --------------------------------------------------------------------------


async def test_a_worker_gone_before_the_switch_goes_back_unhealthy(fleet):
    conversion = await fleet.start(fleet.p0)
    fleet.model(fleet.p0).gone = True
    await asyncio.wait_for(conversion.wait(), WAIT)
    assert conversion.status is Status.RESTORED
    assert "unreachable" in conversion.message
    assert back_in_old_pool(fleet.p0)
    assert [w for w, _ in fleet.reported_down] == [fleet.p0]


async def test_a_switch_call_unanswered_by_a_live_worker_leaves_it_failed(fleet):
    fleet.model(fleet.p0).switch_replies.append(
        ControlError(fleet.p0.url, SWITCH_PATH, "timed out")
    )
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.FAILED
    assert "role unknown" in conversion.message
    assert fleet.p0.state is WorkerState.FAILED


async def test_a_switch_call_unanswered_by_a_worker_that_died_puts_it_back_unhealthy(fleet):
    fleet.model(fleet.p0).switch_replies.append(
        ControlError(fleet.p0.url, SWITCH_PATH, "server disconnected")
    )
    conversion = await fleet.gone_while_switching(fleet.p0)
    assert conversion.status is Status.RESTORED
    assert back_in_old_pool(fleet.p0)
    assert fleet.reported_down


async def test_an_extension_worker_gone_before_its_admission_closes_goes_back(ext_fleet):
    ext_fleet.p0.has_extensions = True
    ext_fleet.model(ext_fleet.p0).gone = True
    conversion = await ext_fleet.run(ext_fleet.p0)
    assert conversion.status is Status.RESTORED
    assert back_in_old_pool(ext_fleet.p0)


# --- the record -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "status"),
    [
        (OK_SWITCH, Status.SUCCEEDED),
        (REFUSED_SAFE, Status.RESTORED),
        (REFUSED_UNSAFE, Status.FAILED),
    ],
)
async def test_every_ending_is_counted_once_and_leaves_no_phase_open(fleet, reply, status):
    fleet.model(fleet.p0).switch_replies.append(reply)
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is status
    assert fleet.counted(status) == 1
    assert all(phase.ended_at is not None for phase in conversion.phases)
    assert conversion.done and fleet.manager.active() == []
    assert fleet.p0.conversion_id is None


async def test_success_listeners_hear_of_a_succeeded_conversion_only(fleet):
    heard: list[tuple[Worker, Role]] = []
    fleet.manager.on_succeeded(lambda worker, role: heard.append((worker, role)))
    fleet.model(fleet.p1).switch_replies.append(REFUSED_SAFE)
    await fleet.run(fleet.p1)
    await fleet.run(fleet.p0)
    assert heard == [(fleet.p0, Role.DECODE)]


# --- on a stepped clock -----------------------------------------------------------------------


async def test_a_safe_refusal_while_the_worker_reads_idle_ends_restored_once_they_disagree():
    fleet = Fleet(clock=FakeClock(step=0.3))
    fleet.model(fleet.p0).switch_replies.extend([REFUSED_IDLE] * 10)
    conversion = await fleet.run(fleet.p0)
    assert conversion.status is Status.RESTORED
    assert "worker unchanged" in conversion.message
    assert back_in_old_pool(fleet.p0)


async def test_a_busy_worker_ends_the_conversion_at_the_drain_timeout_of_the_clock():
    fleet = Fleet(clock=FakeClock(step=1.0))
    model = fleet.model(fleet.p0)
    model.running = 1
    model.switch_replies.extend([NOT_IDLE] * 20)
    conversion = await fleet.run(fleet.p0, drain_timeout_secs=5.0)
    assert conversion.status is Status.DRAIN_TIMEOUT
    assert fleet.control.called(fleet.p0.url, SWITCH_PATH) < 20


# --- a conversion whose replica went --------------------------------------------------------


async def test_an_orphaned_worker_is_settled_in_the_role_it_reports(fleet):
    fleet.model(fleet.p0).role = Role.DECODE
    assert await fleet.manager.settle_orphan(fleet.p0, Role.PREFILL) == (Role.DECODE, 8998)


async def test_an_orphaned_worker_left_draining_gets_its_admission_back(ext_fleet):
    model = ext_fleet.model(ext_fleet.p0)
    model.admitting = False
    await ext_fleet.manager.settle_orphan(ext_fleet.p0, Role.PREFILL)
    assert model.admitting


async def test_an_orphaned_worker_still_draining_is_read_until_the_drain_timeout():
    fleet = Fleet(clock=FakeClock(step=1.0), drain_timeout_secs=3.0)
    model = fleet.model(fleet.p0)
    model.admitting, model.reopens = False, False
    role, _ = await asyncio.wait_for(fleet.manager.settle_orphan(fleet.p0, Role.PREFILL), WAIT)
    assert role is Role.PREFILL
    assert 2 <= fleet.control.called(fleet.p0.url, "/pd_role") <= 5


async def test_an_orphaned_worker_that_cannot_be_read_keeps_the_role_it_had(fleet):
    fleet.model(fleet.p0).gone = True
    assert await fleet.manager.settle_orphan(fleet.p0, Role.PREFILL) == (Role.PREFILL, None)
