"""How a conversion drains and switches a worker, over each control protocol.

Native SGLang takes ``POST /pd_role_switch`` only when fully idle and does not drain by itself: the
router's own drain is all there is, and a "not idle" refusal is retried with a short backoff. The
extension (server_patch, pd_worker) closes the worker's admission first (``/pd_drain``), so another
router cannot slip traffic in, and ``/convert_pd_role`` waits for idle on the server side before it
switches. The runner (:mod:`pd_router.control.conversion.manager`) drives the same state machine
over either; what goes wrong in a step is raised as :class:`Stop`, which names the outcome."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pd_protocol.backoff import Backoff
from pd_protocol.wire import CONVERT_PATH, SWITCH_PATH
from pd_router.control.conversion.history import Conversion, Status
from pd_router.control.worker_control import ControlError, LoadReading, SwitchReply, WorkerControl
from pd_router.control.workers import Worker

IDLE_POLL_FIRST_SECS = 0.002
IDLE_POLL_MAX_SECS = 0.05
# How long a worker whose load reads idle may still refuse a switch as busy before the refusal
# is taken for another reason.
IDLE_AGREEMENT_SECS = 0.5
# What SGLang's refusal of a switch on a busy server says ("instance is not idle; drain all
# requests before switching").
NOT_IDLE = "not idle"


class Stop(Exception):
    """Ends a conversion early: where the worker goes and what the record says."""

    def __init__(
        self, status: Status, message: str, *, restore: bool, healthy: bool = True
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.restore = restore
        self.healthy = healthy


def lost(exc: ControlError) -> Stop:
    """The worker is gone and no switch took effect in a running process: it goes back to its
    old pool, marked unhealthy until the health probe sees it again."""
    return Stop(
        Status.RESTORED,
        f"worker unreachable ({exc.reason}); back in its old pool, unhealthy",
        restore=True,
        healthy=False,
    )


def refused_busy(reply: SwitchReply) -> bool:
    """SGLang's own word that it still has work (``is_fully_idle`` is false). It can say so while
    its load reading shows nothing running or waiting: a decode frees the KV of a transfer that
    failed or was aborted only later (``has_pending_deferred_releases``, up to 30 s in 0.5.23), and
    no load field counts that. So this refusal is retried until the deadline whatever the load."""
    return NOT_IDLE in reply.message


def refused_request(reply: SwitchReply) -> bool:
    """The call was refused before any switch began, so nothing changed: the extension refused
    the body (it names the field), or a 4xx came without the switch reply's shape (auth,
    routing or validation in front of the handler)."""
    if not 400 <= reply.status < 500:
        return False
    return bool(reply.body.get("field")) or "success" not in reply.body


class ControlProtocol(ABC):
    """The steps a protocol does its own way, and the switch loop both share."""

    name: str

    def __init__(self, control: WorkerControl, clock: Callable[[], float] = time.monotonic) -> None:
        self.control = control
        # What the deadlines and the idle agreement are read against (a test steps it).
        self._clock = clock

    @abstractmethod
    async def close_admission(self, conv: Conversion) -> None:
        """Stop new traffic at the worker itself, where the protocol can."""

    @abstractmethod
    async def reopen_admission(self, conv: Conversion) -> None:
        """Undo :meth:`close_admission`; raises ControlError when the worker does not answer."""

    @abstractmethod
    def switch_fields(self, conv: Conversion, deadline: float) -> dict[str, Any]:
        """Fields of the switch body beyond the role and the decode graph parameters."""

    @abstractmethod
    async def call(self, conv: Conversion, body: dict[str, Any]) -> tuple[str, SwitchReply]:
        """One switch call; returns the path it called and the reply."""

    async def switch_until_idle(
        self, conv: Conversion, body: dict[str, Any], deadline: float
    ) -> tuple[SwitchReply, LoadReading | None]:
        """Call the switch; while the worker refuses because it still runs requests (a safe
        refusal and a busy load reading), back off and call again until the deadline. Returns
        the last reply and, when the deadline passed with the worker busy, its load."""
        pause = Backoff(IDLE_POLL_FIRST_SECS, IDLE_POLL_MAX_SECS)
        conv.timings["worker_switch_s"] = 0.0
        idle_since: float | None = None
        while True:
            reply, took = await self._timed_call(conv, body)
            conv.timings["worker_switch_s"] += took
            if reply.success or not reply.safe_to_restore or refused_request(reply):
                return reply, None
            if not conv.request.drain:
                return reply, None
            load = await self.read_load(conv)
            now = self._clock()
            if load.idle and not refused_busy(reply):
                # The load reading may turn idle a moment before the switch's own idleness
                # check does (a request's last bookkeeping); past that, the refusal is another.
                idle_since = now if idle_since is None else idle_since
                if now - idle_since > IDLE_AGREEMENT_SECS:
                    return reply, None
            else:
                idle_since = None
            if now + pause.secs > deadline:
                return reply, load
            await pause.sleep()

    async def read_load(self, conv: Conversion) -> LoadReading:
        try:
            reading = await self.control.read_load(conv.worker)
        except ControlError as exc:
            raise lost(exc) from exc
        conv.progress["worker_running"] = reading.num_running
        conv.progress["worker_waiting"] = reading.num_waiting
        return reading

    async def _timed_call(
        self, conv: Conversion, body: dict[str, Any]
    ) -> tuple[SwitchReply, float]:
        started = time.monotonic()
        try:
            path, reply = await self.call(conv, body)
        except ControlError as exc:
            conv.reply(exc.path, None, {"error": exc.reason})
            if not exc.delivered or not await self._answers(conv.worker):
                raise lost(exc) from exc
            raise Stop(
                Status.FAILED,
                f"no answer to the switch call, role unknown: {exc.reason}",
                restore=False,
            ) from exc
        conv.reply(path, reply.status, reply.body)
        return reply, time.monotonic() - started

    async def _answers(self, worker: Worker) -> bool:
        """Whether the worker's process still accepts connections. After a switch call that
        got no reply, a process that is gone took any half-done switch with it (a restart
        begins from its launch arguments), so only a live worker's role is unknown."""
        try:
            await self.control.read_role(worker)
        except ControlError as exc:
            return exc.delivered
        return True


class NativeProtocol(ControlProtocol):
    """``/pd_role_switch`` only: the router's own drain is the whole drain, and the worker's
    admission cannot be closed."""

    name = "native"

    async def close_admission(self, conv: Conversion) -> None:
        return None

    async def reopen_admission(self, conv: Conversion) -> None:
        return None

    def switch_fields(self, conv: Conversion, deadline: float) -> dict[str, Any]:
        return {}

    async def call(self, conv: Conversion, body: dict[str, Any]) -> tuple[str, SwitchReply]:
        return SWITCH_PATH, await self.control.switch(conv.worker, body)


class ExtensionProtocol(ControlProtocol):
    """``/pd_drain`` around the conversion, ``/convert_pd_role`` (server-side drain) for the
    switch when the caller asked for a drain, ``/pd_role_switch`` when not."""

    name = "extension"

    async def close_admission(self, conv: Conversion) -> None:
        try:
            await self.control.set_admission(conv.worker, open_=False)
        except ControlError as exc:
            if exc.status is None:
                raise lost(exc) from exc
            raise Stop(
                Status.RESTORED,
                f"worker refused to close its admission: {exc.reason}",
                restore=True,
            ) from exc
        conv.admission_closed = True

    async def reopen_admission(self, conv: Conversion) -> None:
        if not conv.admission_closed:
            return
        await self.control.set_admission(conv.worker, open_=True)
        conv.admission_closed = False

    def switch_fields(self, conv: Conversion, deadline: float) -> dict[str, Any]:
        if not conv.request.drain:
            return {}
        return {
            **conv.request.extra,
            "drain_timeout_secs": max(0.0, round(deadline - self._clock(), 3)),
        }

    async def call(self, conv: Conversion, body: dict[str, Any]) -> tuple[str, SwitchReply]:
        if not conv.request.drain:
            return SWITCH_PATH, await self.control.switch(conv.worker, body)
        reply = await self.control.convert(conv.worker, body)
        # After a conversion the worker reopened admission itself; after a refusal of the body
        # it did not, so the router reopens it on the way back.
        conv.admission_closed = not reply.success
        return CONVERT_PATH, reply


def protocol_for(
    control: WorkerControl, extensions: bool, clock: Callable[[], float] = time.monotonic
) -> ControlProtocol:
    return ExtensionProtocol(control, clock) if extensions else NativeProtocol(control, clock)
