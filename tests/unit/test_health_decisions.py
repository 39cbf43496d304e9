"""What a probe's result does to a worker (pd_router/control/health.py, HealthMonitor.apply):
the thresholds that turn it unhealthy and healthy again, and how a live-role reading brings the
registry in line (role drift, restart, bootstrap port, admission). No probe is sent: each test
hands the monitor the result a probe would have found."""

from __future__ import annotations

import pytest

from pd_router.config import HealthConfig
from pd_router.control.health import HealthMonitor, ProbeRecord, ProbeResult
from pd_router.control.worker_control import RoleReading
from pd_router.control.workers import Worker, WorkerRegistry, WorkerState
from pd_router.metrics import RouterMetrics
from pd_router.roles import Role

URL = "http://10.0.0.1:30000"
FAILED = ProbeResult(ok=False, epoch=0, error="health probe answered 500")
REFUSED = ProbeResult(ok=False, epoch=0, error="connection refused", refused=True)


def passed(reading: RoleReading | None = None, *, epoch: int = 0, detected: bool = False):
    return ProbeResult(ok=True, epoch=epoch, reading=reading, detected=detected)


def prefill_reading(**fields: object) -> RoleReading:
    return RoleReading(**{"role": Role.PREFILL, "bootstrap_port": 8998, **fields})  # type: ignore[arg-type]


class Monitor:
    """A registry with one prefill, and the monitor that feeds it (failure threshold 3,
    success threshold 2)."""

    def __init__(self, *, healthy: bool = True, enabled: bool = True) -> None:
        self.registry = WorkerRegistry(RouterMetrics())
        self.worker = self.registry.add(URL, Role.PREFILL, 8998, healthy=healthy)
        self.monitor = HealthMonitor(
            self.registry,
            HealthConfig(failure_threshold=3, success_threshold=2, enabled=enabled),
        )

    def apply(self, *results: ProbeResult) -> bool:
        healthy = True
        for result in results:
            healthy = self.monitor.apply(self.worker, result)
        return healthy


def open_circuit(worker: Worker) -> None:
    for _ in range(worker.circuit.config.failure_threshold):
        worker.circuit.record_failure()
    assert not worker.circuit.allows()


# --- health thresholds ------------------------------------------------------------------------


def test_a_first_probe_that_fails_makes_the_worker_unhealthy_at_once():
    m = Monitor()
    assert m.apply(FAILED) is False
    assert m.worker.last_error == FAILED.error


def test_a_first_probe_that_passes_makes_an_unhealthy_worker_healthy_at_once():
    m = Monitor(healthy=False)
    assert m.apply(passed()) is True


def test_failures_below_the_threshold_keep_the_worker_healthy_with_the_error_noted():
    m = Monitor()
    assert m.apply(passed(), FAILED, FAILED) is True
    assert m.worker.last_error == FAILED.error


def test_the_failure_threshold_makes_the_worker_unhealthy():
    m = Monitor()
    assert m.apply(passed(), FAILED, FAILED, FAILED) is False


def test_a_success_between_failures_starts_the_count_over():
    m = Monitor()
    assert m.apply(passed(), FAILED, FAILED, passed(), FAILED, FAILED) is True


def test_a_refused_connection_makes_the_worker_unhealthy_at_once():
    m = Monitor()
    assert m.apply(passed(), REFUSED) is False


def test_a_success_after_a_failure_below_the_threshold_clears_the_error():
    m = Monitor()
    m.apply(passed(), FAILED, passed())
    assert m.worker.last_error is None


def test_an_unhealthy_worker_needs_the_success_threshold_to_come_back():
    m = Monitor()
    m.apply(FAILED)
    assert m.apply(passed()) is False
    assert m.apply(passed()) is True


def test_a_recovered_worker_gets_its_circuit_closed():
    m = Monitor()
    m.apply(FAILED)
    open_circuit(m.worker)
    m.apply(passed(), passed())
    assert m.worker.circuit.allows() and m.worker.selectable


def test_a_healthy_worker_keeps_a_circuit_that_opened_without_the_probes_seeing_anything():
    m = Monitor()
    m.apply(passed())
    open_circuit(m.worker)
    m.apply(passed(), passed())
    assert not m.worker.circuit.allows()


def test_turning_unhealthy_tells_the_unavailability_listeners():
    m = Monitor()
    told: list[str] = []
    m.registry.on_unavailable(lambda worker, why: told.append(why))
    m.apply(passed(), REFUSED)
    assert told == ["unhealthy"]


# --- the live role reading --------------------------------------------------------------------


def test_a_worker_serving_another_role_moves_to_that_pool():
    m = Monitor()
    m.apply(passed(RoleReading(Role.DECODE, None)))
    assert (m.worker.role, m.worker.epoch) == (Role.DECODE, 1)
    assert m.registry.in_role(Role.DECODE) == [m.worker]


def test_a_decode_turned_prefill_takes_its_bootstrap_port():
    m = Monitor()
    m.apply(passed(RoleReading(Role.DECODE, None)))
    m.apply(passed(RoleReading(Role.PREFILL, 9100), epoch=1))
    assert (m.worker.role, m.worker.bootstrap_port) == (Role.PREFILL, 9100)


def test_a_reading_taken_before_a_conversion_moved_the_worker_is_dropped():
    m = Monitor()
    m.apply(passed(RoleReading(Role.DECODE, None), epoch=m.worker.epoch + 1))
    assert m.worker.role is Role.PREFILL


@pytest.mark.parametrize("state", [WorkerState.DRAINING, WorkerState.SWITCHING])
def test_a_worker_a_conversion_holds_is_left_to_it(state):
    m = Monitor()
    m.registry.claim_for_conversion(m.worker, "c1", lambda: None)
    if state is WorkerState.SWITCHING:
        m.registry.advance_conversion(m.worker, "c1", state)
    m.apply(passed(RoleReading(Role.DECODE, None)))
    assert (m.worker.role, m.worker.state) == (Role.PREFILL, state)


def test_a_reading_about_a_removed_worker_is_dropped():
    m = Monitor()
    m.registry.begin_removal(m.worker)
    m.registry.forget(m.worker)
    m.apply(passed(RoleReading(Role.DECODE, None)))
    assert m.worker.role is Role.PREFILL


def test_a_reading_without_a_role_leaves_the_worker_where_it_is():
    m = Monitor()
    m.apply(passed(RoleReading(None, None)))
    assert m.worker.role is Role.PREFILL


def test_a_prefill_reporting_another_bootstrap_port_is_sent_to_it():
    m = Monitor()
    m.apply(passed(prefill_reading(bootstrap_port=9000)))
    assert m.worker.bootstrap_port == 9000


def test_a_decode_reporting_a_bootstrap_port_keeps_none():
    m = Monitor()
    m.registry.adopt_role(m.worker, Role.DECODE)
    m.apply(passed(RoleReading(Role.DECODE, 9000), epoch=1))
    assert m.worker.bootstrap_port == 8998


def test_a_draining_worker_leaves_selection_but_stays_healthy_and_comes_back():
    m = Monitor()
    m.apply(passed(prefill_reading(draining=True)))
    assert (m.worker.healthy, m.worker.admitting, m.worker.selectable) == (True, False, False)
    m.apply(passed(prefill_reading(draining=False)))
    assert m.worker.selectable


def test_whether_the_worker_can_switch_is_kept():
    m = Monitor()
    m.apply(passed(prefill_reading(switch_supported=False)))
    assert m.worker.switch_supported is False


# --- restarts ---------------------------------------------------------------------------------


def test_a_new_start_signature_closes_the_circuit_and_forgets_the_protocol():
    m = Monitor()
    m.registry.set_extensions(m.worker, True)
    m.apply(passed(prefill_reading(instance="a")))
    open_circuit(m.worker)
    m.apply(passed(prefill_reading(instance="b")))
    assert m.worker.circuit.allows()
    assert m.worker.has_extensions is None


def test_a_restart_the_reading_just_detected_keeps_the_protocol_it_found():
    m = Monitor()
    m.registry.set_extensions(m.worker, True)
    m.apply(passed(prefill_reading(instance="a")))
    m.apply(passed(prefill_reading(instance="b"), detected=True))
    assert m.worker.has_extensions is True


def test_the_same_start_signature_is_no_restart():
    m = Monitor()
    m.apply(passed(prefill_reading(instance="a")))
    open_circuit(m.worker)
    m.apply(passed(prefill_reading(instance="a")))
    assert not m.worker.circuit.allows()


@pytest.mark.parametrize(
    ("before", "after", "restarted"),
    [
        (RoleReading(None, None, instance="a"), RoleReading(None, None, instance="b"), True),
        (RoleReading(None, None, instance="a"), RoleReading(None, None, instance="a"), False),
        (RoleReading(None, None, instance=None), RoleReading(None, None, instance="b"), False),
        (RoleReading(None, None, epoch=3), RoleReading(None, None, epoch=1), True),
        (RoleReading(None, None, epoch=3), RoleReading(None, None, epoch=4), False),
        (RoleReading(None, None, epoch=None), RoleReading(None, None, epoch=0), False),
    ],
    ids=[
        "new instance",
        "same instance",
        "first signature",
        "epoch back",
        "epoch on",
        "first epoch",
    ],
)
def test_a_restart_is_another_signature_or_an_epoch_that_went_back(before, after, restarted):
    record = ProbeRecord()
    record.restarted(before)
    assert record.restarted(after) is restarted


def test_the_probe_record_says_which_probe_was_the_first():
    record = ProbeRecord()
    assert record.count(True) is True
    assert record.count(False) is False
    assert (record.successes, record.failures) == (0, 1)


# --- reports from elsewhere -------------------------------------------------------------------


def test_a_worker_reported_down_with_probes_on_is_out_until_a_probe_passes():
    m = Monitor()
    m.apply(passed(), passed())
    m.monitor.report_down(m.worker, "reopening admission failed")
    assert not m.worker.healthy
    assert m.apply(FAILED) is False
    assert m.apply(passed()) is False
    assert m.apply(passed()) is True


def test_a_worker_reported_down_with_probes_off_keeps_its_health_and_the_error():
    m = Monitor(enabled=False)
    m.monitor.report_down(m.worker, "reopening admission failed")
    assert m.worker.healthy and m.worker.last_error == "reopening admission failed"
