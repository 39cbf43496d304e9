"""Role conversion: drain a worker, switch its role in process, verify, re-register it.

One conversion moves one worker ACTIVE -> DRAINING -> SWITCHING -> ACTIVE under its new role
(epoch + 1). Everything that can be refused is refused before the worker's state changes (409),
and every later failure ends in a defined place: back in the old pool (abort, drain timeout, a
failure the worker calls ``safe_to_restore``, the worker gone during the drain) or FAILED, out of
every pool (a failed switch without ``safe_to_restore``, no answer to the switch, a worker that
reports another role than the one it claims to have switched to). The drain waits on the
router's own in-flight count through the registry's event, so the switch is called as soon as the
last request ends, not at the next tick of a poll.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pd_router.control import ControlError, LoadReading, SwitchReply, WorkerControl
from pd_router.errors import BadRequest, Conflict, NotFound, UpstreamError
from pd_router.metrics import RouterMetrics
from pd_router.workers import (
    Role,
    UnknownWorker,
    Worker,
    WorkerRegistry,
    WorkerState,
)

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_SECS = 300.0
IDLE_POLL_FIRST_SECS = 0.002
IDLE_POLL_MAX_SECS = 0.05
HISTORY_SIZE = 200
PHASES = ("drain", "switch", "verify", "total")


class ConversionRefused(Conflict):
    """Refused before anything changed; ``reason`` is a stable code for scripts."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, details={"reason": reason})
        self.reason = reason


class AlreadyInRole(ConversionRefused):
    def __init__(self, worker: Worker) -> None:
        super().__init__("already_in_role", f"worker {worker.url} is already a {worker.role}")
        self.worker = worker


class KnobNotAccepted(BadRequest):
    """A PR #9325 knob sent for a worker whose control API (native SGLang) takes none."""

    def __init__(self, name: str, worker: Worker) -> None:
        super().__init__(
            f"{name} is not accepted by the control API of {worker.url} (native /pd_role_switch)",
            details={"field": name},
        )
        self.field = name


class ConversionNotFound(NotFound):
    def __init__(self, conversion_id: str) -> None:
        super().__init__(f"no conversion with id {conversion_id!r}")


class WorkerUnreachable(UpstreamError):
    def __init__(self, error: ControlError) -> None:
        super().__init__(f"worker not reachable, nothing changed: {error}")


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
    _abort: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _t0: float = field(default_factory=time.monotonic, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in FINAL

    @property
    def succeeded(self) -> bool:
        return self.status is Status.SUCCEEDED

    async def wait(self) -> None:
        await self._done.wait()

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


class _Stop(Exception):
    """Ends a conversion early: where the worker goes and what the record says."""

    def __init__(
        self, status: Status, message: str, *, restore: bool, healthy: bool = True
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.restore = restore
        self.healthy = healthy


class ConversionManager:
    """Runs conversions: validation, the per-worker lock, the global cap, history, metrics."""

    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        control: WorkerControl,
        *,
        min_prefill: int = 1,
        min_decode: int = 1,
        max_concurrent: int = 1,
        drain_timeout_secs: float = DEFAULT_DRAIN_TIMEOUT_SECS,
        history_size: int = HISTORY_SIZE,
    ) -> None:
        self._registry = registry
        self._metrics = metrics
        self._control = control
        self._minimum = {Role.PREFILL: min_prefill, Role.DECODE: min_decode}
        self._max_concurrent = max_concurrent
        self._drain_timeout = drain_timeout_secs
        self._history_size = history_size
        self._ids = itertools.count(1)
        self._active: dict[str, Conversion] = {}
        self._history: OrderedDict[str, Conversion] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._export_zero_series()

    def _export_zero_series(self) -> None:
        """Create every conversion series at 0 before the first conversion: a counter series
        that first appears at 1 is invisible to ``increase()``, so the first failed conversion
        would neither fire the alert nor mark the dashboard."""
        for from_role in Role:
            for outcome in FINAL:
                self._metrics.conversions_total.labels(
                    from_role.value, from_role.other.value, outcome.value
                )
        for phase in PHASES:
            self._metrics.conversion_phase_seconds.labels(phase)

    # --- queries ----------------------------------------------------------------------------

    def get(self, conversion_id: str) -> Conversion:
        conversion = self._history.get(conversion_id)
        if conversion is None:
            raise ConversionNotFound(conversion_id)
        return conversion

    def history(self) -> Iterator[Conversion]:
        """Newest first."""
        return reversed(list(self._history.values()))

    def active(self) -> list[Conversion]:
        return list(self._active.values())

    # --- commands ---------------------------------------------------------------------------

    async def start(self, request: ConversionRequest) -> Conversion:
        """Validate, move the worker to DRAINING and run the conversion in the background.

        Every refusal (409) happens before the worker's state changes. The checks and the move to
        DRAINING run without an await in between, so two requests at once cannot both pass the
        pool minimum or the cap.
        """
        worker = self._lookup(request.worker)
        try:
            extensions = await self._control.detect_extensions(worker)
        except ControlError as exc:
            raise WorkerUnreachable(exc) from exc
        if request.extra and not extensions:
            raise KnobNotAccepted(sorted(request.extra)[0], worker)
        target = request.new_role or worker.role.other
        self._refuse_if_unsafe(worker, target)
        conversion = Conversion(
            id=f"c{next(self._ids)}",
            worker=worker,
            from_role=worker.role,
            to_role=target,
            request=request,
            protocol="extension" if extensions else "native",
        )
        self._active[worker.url] = conversion
        self._remember(conversion)
        conversion.phases.append(PhaseRecord("drain", time.time()))
        self._registry.set_state(worker, WorkerState.DRAINING)
        logger.info(
            "conversion %s: %s %s -> %s started (%s protocol)",
            conversion.id, worker.url, conversion.from_role, target, conversion.protocol,
        )  # fmt: skip
        task = asyncio.create_task(self._run(conversion), name=f"conversion-{conversion.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conversion

    def abort(self, conversion_id: str) -> Conversion:
        """Stop a conversion that is still draining; the worker goes back to its old pool."""
        conversion = self.get(conversion_id)
        if conversion.status is not Status.DRAINING:
            raise ConversionRefused(
                "not_abortable",
                f"conversion {conversion_id} is {conversion.status}; only a draining "
                "conversion can be aborted",
            )
        conversion._abort.set()
        logger.info("conversion %s: abort requested", conversion_id)
        return conversion

    async def close(self) -> None:
        """Cancel running conversions (router shutdown)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- validation -------------------------------------------------------------------------

    def _lookup(self, key: str) -> Worker:
        try:
            return self._registry.get(key)
        except UnknownWorker as exc:
            raise ConversionRefused("unknown_worker", str(exc)) from exc

    def _refuse_if_unsafe(self, worker: Worker, target: Role) -> None:
        if worker.url in self._active:
            raise ConversionRefused(
                "already_converting",
                f"worker {worker.url} is already converting ({self._active[worker.url].id})",
            )
        if worker.state is not WorkerState.ACTIVE:
            raise ConversionRefused(
                "not_active", f"worker {worker.url} is {worker.state}, not active"
            )
        if target is worker.role:
            raise AlreadyInRole(worker)
        if len(self._active) >= self._max_concurrent:
            raise ConversionRefused(
                "too_many_conversions",
                f"{len(self._active)} conversion(s) running; the limit is {self._max_concurrent}",
            )
        remaining = self._registry.active_healthy_count(worker.role) - (1 if worker.healthy else 0)
        minimum = self._minimum[worker.role]
        if remaining < minimum:
            raise ConversionRefused(
                f"min_{worker.role.value}",
                f"converting {worker.url} would leave {remaining} active healthy "
                f"{worker.role} worker(s); the minimum is {minimum}",
            )

    # --- the conversion ---------------------------------------------------------------------

    async def _run(self, conv: Conversion) -> None:
        deadline = time.monotonic() + (
            conv.request.drain_timeout_secs
            if conv.request.drain_timeout_secs is not None
            else self._drain_timeout
        )
        peer_params = asyncio.create_task(self._decode_peer_params(conv))
        try:
            await self._drain(conv, deadline)
            reply = await self._switch(conv, deadline, await self._peer_params(conv, peer_params))
            await self._verify(conv, reply)
        except _Stop as stop:
            await self._stop(conv, stop)
        except asyncio.CancelledError:
            await self._stop(conv, _Stop(Status.ABORTED, "router shutting down", restore=True))
            raise
        except Exception as exc:
            # A bug must not leave the worker stuck out of every pool: before the switch call it
            # goes back (its role did not change), after it the role is unknown.
            logger.exception("conversion %s: unexpected error", conv.id)
            before_switch = conv.status is Status.DRAINING
            await self._stop(
                conv,
                _Stop(
                    Status.RESTORED if before_switch else Status.FAILED,
                    f"internal error: {type(exc).__name__}",
                    restore=before_switch,
                ),
            )
        finally:
            peer_params.cancel()
            self._finish(conv)

    async def _drain(self, conv: Conversion, deadline: float) -> None:
        """Close admission (extension), then wait for the router's in-flight count to reach zero
        (event); abort and timeout end it. Whatever else the worker still runs (traffic from
        another router) is waited for by the switch itself: the extension's /convert_pd_role
        waits for idle on the server, a native "not idle" refusal is retried with a short
        backoff. Asking the worker first would put one more round trip between the last
        request ending and the switch."""
        worker = conv.worker
        conv.progress["router_inflight_at_start"] = worker.inflight
        if conv.protocol == "extension":
            try:
                await self._control.set_admission(worker, open_=False)
            except ControlError as exc:
                if exc.status is None:
                    raise self._lost(exc) from exc
                raise _Stop(
                    Status.RESTORED,
                    f"worker refused to close its admission: {exc.reason}",
                    restore=True,
                ) from exc
            conv.admission_closed = True
        if conv.request.drain:
            await self._wait_router_idle(conv, deadline)
        conv.timings["router_idle_at"] = time.monotonic()
        conv.timings["drain_s"] = conv.phases[-1].end()
        logger.info("conversion %s: drained in %.3fs", conv.id, conv.timings["drain_s"])

    async def _wait_router_idle(self, conv: Conversion, deadline: float) -> None:
        idle = asyncio.ensure_future(conv.worker.wait_until_no_inflight())
        abort = asyncio.ensure_future(conv._abort.wait())
        try:
            await asyncio.wait(
                {idle, abort},
                timeout=max(0.0, deadline - time.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            idle.cancel()
            abort.cancel()
        self._check_abort(conv)
        if not idle.done() or idle.cancelled():
            raise _Stop(
                Status.DRAIN_TIMEOUT,
                f"drain timed out with {conv.worker.inflight} request(s) still in flight "
                "through this router",
                restore=True,
            )

    async def _peer_params(
        self, conv: Conversion, fetch: asyncio.Task[dict[str, Any]]
    ) -> dict[str, Any]:
        """The decode peer's graph parameters once fetched; the conversion is still DRAINING
        (abortable) until the switch call, so an abort meanwhile ends it at once."""
        abort = asyncio.ensure_future(conv._abort.wait())
        try:
            await asyncio.wait({fetch, abort}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            abort.cancel()
        self._check_abort(conv)
        return fetch.result()

    async def _read_load(self, conv: Conversion) -> LoadReading:
        try:
            reading = await self._control.read_load(conv.worker)
        except ControlError as exc:
            raise self._lost(exc) from exc
        conv.progress["worker_running"] = reading.num_running
        conv.progress["worker_waiting"] = reading.num_waiting
        return reading

    def _check_abort(self, conv: Conversion) -> None:
        if conv._abort.is_set():
            raise _Stop(Status.ABORTED, "aborted by the operator while draining", restore=True)

    async def _answers(self, worker: Worker) -> bool:
        """Whether the worker's process still accepts connections. After a switch call that
        got no reply, a process that is gone took any half-done switch with it (a restart
        begins from its launch arguments), so only a live worker's role is unknown."""
        try:
            await self._control.read_role(worker)
        except ControlError as exc:
            return exc.delivered
        return True

    def _lost(self, exc: ControlError) -> _Stop:
        """The worker is gone and no switch took effect in a running process: it goes back to
        its old pool, marked unhealthy until the health probe sees it again."""
        return _Stop(
            Status.RESTORED,
            f"worker unreachable ({exc.reason}); back in its old pool, unhealthy",
            restore=True,
            healthy=False,
        )

    async def _switch(
        self, conv: Conversion, deadline: float, peer_params: dict[str, Any]
    ) -> SwitchReply:
        phase = PhaseRecord("switch", time.time())
        conv.phases.append(phase)
        conv.status = Status.SWITCHING
        self._registry.set_state(conv.worker, WorkerState.SWITCHING)
        body = self._switch_body(conv, deadline, peer_params)
        conv.timings["idle_to_switch_s"] = time.monotonic() - conv.timings.pop("router_idle_at")
        reply, busy = await self._switch_until_idle(conv, body, deadline)
        conv.timings["switch_s"] = phase.end()
        if busy is not None:
            raise _Stop(
                Status.DRAIN_TIMEOUT,
                f"drain timed out: the worker still has {busy.num_running} running and "
                f"{busy.num_waiting} waiting request(s)",
                restore=True,
            )
        if reply.success:
            logger.info("conversion %s: switched in %.3fs", conv.id, conv.timings["switch_s"])
            return reply
        if reply.safe_to_restore or _refused_request(reply):
            raise _Stop(
                Status.RESTORED,
                f"switch failed, worker unchanged: {reply.message}",
                restore=True,
            )
        raise _Stop(
            Status.FAILED,
            f"switch failed without safe_to_restore: {reply.message}",
            restore=False,
        )

    async def _switch_until_idle(
        self, conv: Conversion, body: dict[str, Any], deadline: float
    ) -> tuple[SwitchReply, LoadReading | None]:
        """Call the switch; while the worker refuses because it still runs requests (a safe
        refusal and a busy load reading), back off and call again until the deadline. Returns
        the last reply and, when the deadline passed with the worker busy, its load."""
        delay = IDLE_POLL_FIRST_SECS
        conv.timings["worker_switch_s"] = 0.0
        while True:
            reply, took = await self._call_switch(conv, body)
            conv.timings["worker_switch_s"] += took
            if reply.success or not reply.safe_to_restore or _refused_request(reply):
                return reply, None
            if not conv.request.drain:
                return reply, None
            load = await self._read_load(conv)
            if load.idle:
                return reply, None
            if time.monotonic() + delay > deadline:
                return reply, load
            await asyncio.sleep(delay)
            delay = min(delay * 2, IDLE_POLL_MAX_SECS)

    def _switch_body(
        self, conv: Conversion, deadline: float, peer_params: dict[str, Any]
    ) -> dict[str, Any]:
        request = conv.request
        body: dict[str, Any] = {"new_role": conv.to_role.value}
        if conv.to_role is Role.DECODE:
            body.update(peer_params)
        if request.decode_cuda_graph_bs is not None:
            body["decode_cuda_graph_bs"] = request.decode_cuda_graph_bs
        if request.decode_cuda_graph_memory_gb is not None:
            body["decode_cuda_graph_memory_gb"] = request.decode_cuda_graph_memory_gb
        if conv.protocol == "extension" and request.drain:
            body.update(request.extra)
            body["drain_timeout_secs"] = max(0.0, round(deadline - time.monotonic(), 3))
        return body

    async def _call_switch(
        self, conv: Conversion, body: dict[str, Any]
    ) -> tuple[SwitchReply, float]:
        server_side_drain = conv.protocol == "extension" and conv.request.drain
        path = "/convert_pd_role" if server_side_drain else "/pd_role_switch"
        started = time.monotonic()
        try:
            if server_side_drain:
                reply = await self._control.convert(conv.worker, body)
                # After a conversion the worker reopened admission itself; after a refusal of
                # the body it did not, so the router reopens it on the way back.
                conv.admission_closed = not reply.success
            else:
                reply = await self._control.switch(conv.worker, body)
        except ControlError as exc:
            conv.worker_replies.append(_reply_entry(path, None, {"error": exc.reason}))
            if not exc.delivered or not await self._answers(conv.worker):
                raise self._lost(exc) from exc
            raise _Stop(
                Status.FAILED,
                f"no answer to the switch call, role unknown: {exc.reason}",
                restore=False,
            ) from exc
        conv.worker_replies.append(_reply_entry(path, reply.status, reply.body))
        return reply, time.monotonic() - started

    async def _verify(self, conv: Conversion, reply: SwitchReply) -> None:
        phase = PhaseRecord("verify", time.time())
        conv.phases.append(phase)
        conv.status = Status.VERIFYING
        try:
            reading = await self._control.read_role(conv.worker)
        except ControlError as exc:
            raise _Stop(
                Status.FAILED, f"could not read the role back: {exc.reason}", restore=False
            ) from exc
        conv.worker_replies.append(
            _reply_entry(
                "verify",
                200,
                {
                    "role": reading.role.value if reading.role else None,
                    "bootstrap_port": reading.bootstrap_port,
                },
            )
        )
        if reading.role is not conv.to_role:
            raise _Stop(
                Status.FAILED,
                f"worker claimed a switch to {conv.to_role} but reports "
                f"{reading.role or 'no role'}",
                restore=False,
            )
        port = None
        if conv.to_role is Role.PREFILL:
            port = (
                conv.request.bootstrap_port
                or _port(reply.body.get("bootstrap_port"))
                or reading.bootstrap_port
                or conv.worker.bootstrap_port
            )
        await self._reopen(conv)
        conv.timings["verify_s"] = phase.end()
        self._registry.set_state(
            conv.worker, WorkerState.ACTIVE, role=conv.to_role, bootstrap_port=port
        )
        conv.epoch = conv.worker.epoch
        conv.bootstrap_port = conv.worker.bootstrap_port if port is not None else None
        conv.status = Status.SUCCEEDED
        conv.message = f"now a {conv.to_role} (epoch {conv.epoch})"

    async def _reopen(self, conv: Conversion) -> None:
        if not conv.admission_closed:
            return
        try:
            await self._control.set_admission(conv.worker, open_=True)
        except ControlError as exc:
            logger.warning("conversion %s: could not reopen admission: %s", conv.id, exc)
            self._registry.set_health(conv.worker, False, f"reopening admission failed: {exc}")
            return
        conv.admission_closed = False

    async def _stop(self, conv: Conversion, stop: _Stop) -> None:
        conv.status = stop.status
        conv.message = stop.message
        for phase in conv.phases:
            if phase.ended_at is None:
                phase.end()
        worker = conv.worker
        if stop.restore:
            if stop.healthy:
                await self._reopen(conv)
            else:
                self._registry.set_health(worker, False, stop.message)
            self._registry.set_state(worker, WorkerState.ACTIVE)
            logger.warning("conversion %s: %s; back in the %s pool", conv.id, stop, worker.role)
        else:
            worker.last_error = stop.message
            self._registry.set_state(worker, WorkerState.FAILED)
            logger.error("conversion %s: %s; worker %s FAILED", conv.id, stop, worker.url)

    def _finish(self, conv: Conversion) -> None:
        self._active.pop(conv.worker.url, None)
        conv.finished_at = time.time()
        total = time.monotonic() - conv._t0
        conv.timings["total_s"] = total
        conv.timings.pop("router_idle_at", None)
        if conv.succeeded:
            conv.timings["router_overhead_s"] = (
                total - conv.timings["drain_s"] - conv.timings["worker_switch_s"]
            )
        for phase in conv.phases:
            if phase.duration_s is not None:
                self._metrics.conversion_phase_seconds.labels(phase.name).observe(phase.duration_s)
        self._metrics.conversion_phase_seconds.labels("total").observe(total)
        self._metrics.conversions_total.labels(
            conv.from_role.value, conv.to_role.value, conv.status.value
        ).inc()
        conv._done.set()
        logger.info("conversion %s: %s in %.3fs (%s)", conv.id, conv.status, total, conv.message)

    async def _decode_peer_params(self, conv: Conversion) -> dict[str, Any]:
        """Decode graph parameters of a decode peer, fetched while the drain runs, for the ones
        the caller did not give (it may give one and take the other from the peer)."""
        given = (conv.request.decode_cuda_graph_bs, conv.request.decode_cuda_graph_memory_gb)
        if conv.to_role is not Role.DECODE or None not in given:
            return {}
        for peer in self._registry.selectable(Role.DECODE):
            try:
                return await self._control.decode_graph_params(peer.url)
            except ControlError as exc:
                logger.info("conversion %s: decode peer %s: %s", conv.id, peer.url, exc)
        return {}

    def _remember(self, conversion: Conversion) -> None:
        self._history[conversion.id] = conversion
        while len(self._history) > self._history_size:
            oldest_id, oldest = next(iter(self._history.items()))
            if not oldest.finished:
                break
            del self._history[oldest_id]


def _refused_request(reply: SwitchReply) -> bool:
    """The call was refused before any switch began, so nothing changed: the extension refused
    the body (it names the field), or a 4xx came without the switch reply's shape (auth,
    routing or validation in front of the handler)."""
    if not 400 <= reply.status < 500:
        return False
    return bool(reply.body.get("field")) or "success" not in reply.body


def _reply_entry(call: str, status: int | None, body: Any) -> dict[str, Any]:
    return {"call": call, "status": status, "at": time.time(), "body": body}


def _port(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
