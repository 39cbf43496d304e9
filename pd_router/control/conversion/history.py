"""Conversion records, the history ``GET /conversions`` lists, and the conversion metrics.

A :class:`Conversion` is what the runner fills in while it works (status, phases with timestamps,
the worker's replies, timings) and what the API shows. :class:`ConversionHistory` keeps the last
records, newest first, and feeds the finished ones to ``conversions_total`` and
``conversion_phase_seconds``; it holds no worker state (the registry knows which conversion holds
which worker).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pd_router.control.workers import Role, Worker
from pd_router.metrics import RouterMetrics
from pd_router.roles import PD_ROLES

HISTORY_SIZE = 200
PHASES = ("drain", "switch", "verify", "total")


class ConversionNotFound(LookupError):
    def __init__(self, conversion_id: str) -> None:
        super().__init__(f"no conversion with id {conversion_id!r}")


class Status(StrEnum):
    """Where a conversion is; the last five are final and are the ``outcome`` label."""

    DRAINING = "draining"
    SWITCHING = "switching"
    VERIFYING = "verifying"
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    DRAIN_TIMEOUT = "drain_timeout"
    RESTORED = "restored"
    FAILED = "failed"


FINAL = frozenset(
    {Status.SUCCEEDED, Status.ABORTED, Status.DRAIN_TIMEOUT, Status.RESTORED, Status.FAILED}
)


@dataclass(frozen=True)
class ConversionRequest:
    """A validated conversion request (the API layer builds it from either body shape)."""

    worker: str
    new_role: Role | None = None
    drain: bool = True
    drain_timeout_secs: float | None = None
    decode_cuda_graph_bs: list[int] | None = None
    decode_cuda_graph_memory_gb: float | None = None
    bootstrap_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Who asked: "operator" (the admin API, the dashboard, pd-router convert) or "autopilot".
    started_by: str = "operator"


@dataclass
class PhaseRecord:
    name: str
    started_at: float
    ended_at: float | None = None
    duration_s: float | None = None
    _t0: float = field(default_factory=time.monotonic, repr=False)

    def end(self) -> float:
        self.ended_at = time.time()
        self.duration_s = time.monotonic() - self._t0
        return self.duration_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "duration_s": _round(self.duration_s),
        }


@dataclass(eq=False)
class Conversion:
    """One conversion's record: state, phases with timestamps, the worker's replies."""

    id: str
    worker: Worker
    from_role: Role
    to_role: Role
    request: ConversionRequest
    protocol: str
    # The router replica that runs it ("" for a router alone).
    replica: str = ""
    status: Status = Status.DRAINING
    message: str = ""
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    phases: list[PhaseRecord] = field(default_factory=list)
    worker_replies: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    epoch: int | None = None
    bootstrap_port: int | None = None
    admission_closed: bool = False
    abort_reason: str = "by the operator"
    _abort: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    @property
    def succeeded(self) -> bool:
        return self.status is Status.SUCCEEDED

    @property
    def done(self) -> bool:
        """The runner is through with it: the worker handed back, the outcome counted."""
        return self._done.is_set()

    async def wait(self) -> None:
        await self._done.wait()

    def reply(self, call: str, status: int | None, body: Any) -> None:
        """Keep one control call's answer (``worker_replies``)."""
        self.worker_replies.append(
            {"call": call, "status": status, "at": time.time(), "body": body}
        )

    def as_dict(self) -> dict[str, Any]:
        progress = dict(self.progress)
        if not self.finished:
            progress["router_inflight"] = self.worker.inflight
        return {
            "id": self.id,
            "worker_url": self.worker.url,
            "worker_id": self.worker.id,
            "from_role": self.from_role.value,
            "to_role": self.to_role.value,
            "protocol": self.protocol,
            "started_by": self.request.started_by,
            "replica": self.replica or None,
            "request": {
                "drain": self.request.drain,
                "drain_timeout_secs": self.request.drain_timeout_secs,
                "bootstrap_port": self.request.bootstrap_port,
                "decode_cuda_graph_bs": self.request.decode_cuda_graph_bs,
                "decode_cuda_graph_memory_gb": self.request.decode_cuda_graph_memory_gb,
                **self.request.extra,
            },
            "status": self.status.value,
            "success": self.succeeded,
            "message": self.message,
            "created_at": self.created_at,
            "finished_at": self.finished_at,
            "epoch": self.epoch,
            "bootstrap_port": self.bootstrap_port,
            "phases": [p.as_dict() for p in self.phases],
            "progress": progress,
            "timings": {k: _round(v) for k, v in self.timings.items()},
            "worker_replies": list(self.worker_replies),
        }


class ConversionHistory:
    """The last ``size`` conversions (never dropping one that is not done) and their metrics."""

    def __init__(self, metrics: RouterMetrics, size: int = HISTORY_SIZE) -> None:
        self._metrics = metrics
        self._size = size
        self._records: OrderedDict[str, Conversion] = OrderedDict()
        self._export_zero_series()

    def _export_zero_series(self) -> None:
        """Create every conversion series at 0 before the first conversion: a counter series
        that first appears at 1 is invisible to ``increase()``, so the first failed conversion
        would neither fire the alert nor mark the dashboard."""
        for from_role in PD_ROLES:
            for outcome in FINAL:
                self._metrics.conversions_total.labels(
                    from_role.value, from_role.other.value, outcome.value
                )
        for phase in PHASES:
            self._metrics.conversion_phase_seconds.labels(phase)

    def get(self, conversion_id: str) -> Conversion:
        conversion = self._records.get(conversion_id)
        if conversion is None:
            raise ConversionNotFound(conversion_id)
        return conversion

    def __contains__(self, conversion_id: object) -> bool:
        return conversion_id in self._records

    def newest_first(self) -> Iterator[Conversion]:
        return reversed(list(self._records.values()))

    def remember(self, conversion: Conversion) -> None:
        self._records[conversion.id] = conversion
        while len(self._records) > self._size:
            oldest_id, oldest = next(iter(self._records.items()))
            if not oldest.done:
                break
            del self._records[oldest_id]

    def record_finished(self, conversion: Conversion, total_s: float) -> None:
        """Count a finished conversion's outcome and observe every phase it entered."""
        for phase in conversion.phases:
            if phase.duration_s is not None:
                self._metrics.conversion_phase_seconds.labels(phase.name).observe(phase.duration_s)
        self._metrics.conversion_phase_seconds.labels("total").observe(total_s)
        self._metrics.conversions_total.labels(
            conversion.from_role.value, conversion.to_role.value, conversion.status.value
        ).inc()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
