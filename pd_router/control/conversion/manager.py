"""Role conversion: drain a worker, switch its role in process, verify, re-register it.

One conversion moves one worker ACTIVE -> DRAINING -> SWITCHING -> ACTIVE under its new role
(epoch + 1). Everything that can be refused is refused before the worker's state changes (409),
and every later failure ends in a defined place: back in the old pool (abort, drain timeout, a
failure the worker calls ``safe_to_restore``, the worker gone during the drain) or FAILED, out of
every pool (a failed switch without ``safe_to_restore``, no answer to the switch, a worker that
reports another role than the one it claims to have switched to). The drain waits on the
router's own in-flight count through the registry's event, so the switch is called as soon as the
last request ends, not at the next tick of a poll.

This module is the runner (the state machine). The registry holds the worker for the conversion
from the claim to the end, so nothing else (a removal, another conversion) can change it
meanwhile; how each step is done over the native or the extension protocol is in
:mod:`pd_router.control.conversion.protocols`; the records and the metrics are in
:mod:`pd_router.control.conversion.history`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from pd_protocol.backoff import Backoff
from pd_protocol.json_values import is_int
from pd_router.control.cluster.local import Cluster, ConversionTaken, LocalCluster
from pd_router.control.conversion.canary import run_canary
from pd_router.control.conversion.history import (
    HISTORY_SIZE,
    Conversion,
    ConversionHistory,
    ConversionRequest,
    PhaseRecord,
    Status,
)
from pd_router.control.conversion.protocols import (
    ControlProtocol,
    Stop,
    protocol_for,
    refused_request,
)
from pd_router.control.conversion.spans import conversion_span
from pd_router.control.errors import (
    AlreadyInRole,
    ConversionRefused,
    KnobNotAccepted,
    NotConvertible,
    WorkerUnreachable,
)
from pd_router.control.worker_control import (
    ControlError,
    RoleReading,
    SwitchReply,
    WorkerControl,
)
from pd_router.control.workers import (
    RegistryError,
    Role,
    UnknownWorker,
    Worker,
    WorkerRegistry,
    WorkerState,
)
from pd_router.metrics import RouterMetrics
from pd_router.tracing import RecordSpan

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_SECS = 300.0
# The canary request's bound (and the switch back's, when it fails): a tiny request through an
# idle pair answers in well under a second; SGLang's KV hand-off gives up only after 300 s.
DEFAULT_CANARY_TIMEOUT_SECS = 30.0
SETTLED_ELSEWHERE = (
    "aborted before the switch call: another replica settled the worker while this one's "
    "lease had lapsed"
)
# How often an orphaned worker that still runs its own conversion is read again.
SETTLE_POLL_FIRST_SECS = 0.05
SETTLE_POLL_MAX_SECS = 1.0

__all__ = [
    "AlreadyInRole",
    "Conversion",
    "ConversionManager",
    "ConversionRefused",
    "ConversionRequest",
    "KnobNotAccepted",
    "Status",
    "WorkerUnreachable",
]


class ConversionManager:
    """Runs conversions: validation, the claim on the worker, the global cap, the steps. Each
    finished conversion goes to ``record_span`` as a span with its phases (None: tracing
    off)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        control: WorkerControl,
        report_down: Callable[[Worker, str], None],
        *,
        min_prefill: int = 1,
        min_decode: int = 1,
        max_concurrent: int = 1,
        drain_timeout_secs: float = DEFAULT_DRAIN_TIMEOUT_SECS,
        canary_timeout_secs: float = DEFAULT_CANARY_TIMEOUT_SECS,
        history_size: int = HISTORY_SIZE,
        cluster: Cluster | None = None,
        clock: Callable[[], float] = time.monotonic,
        record_span: RecordSpan | None = None,
    ) -> None:
        self._registry = registry
        self._record_span = record_span
        self._cluster = cluster or LocalCluster(registry)
        # Where a worker found not answering is reported (the health monitor's report_down).
        self._report_down = report_down
        self._control = control
        self._minimum = {Role.PREFILL: min_prefill, Role.DECODE: min_decode}
        self._max_concurrent = max_concurrent
        self._drain_timeout = drain_timeout_secs
        self._canary_timeout = canary_timeout_secs
        # What the drain deadlines are read against: a test with a LocalCluster steps it (an
        # etcd cluster reads the deadlines it is given against time.monotonic).
        self._clock = clock
        self._history = ConversionHistory(metrics, history_size)
        self._started = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._succeeded: list[Callable[[Worker, Role], None]] = []
        registry.on_adopted(self._forget_if_prefill)

    def _forget_if_prefill(self, worker: Worker) -> None:
        """A worker found to have become a prefill outside a conversion of this router (role
        drift): the decodes forget its old endpoints, as after a conversion to prefill."""
        if worker.role is Role.PREFILL:
            task = asyncio.create_task(
                self._control.forget_prefill_on_decodes(worker, worker.bootstrap_port)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def on_succeeded(self, callback: Callable[[Worker, Role], None]) -> None:
        """Call ``callback(worker, new_role)`` when a conversion of this router succeeded (the
        worker is ACTIVE in its new role); it must not block."""
        self._succeeded.append(callback)

    # --- queries ----------------------------------------------------------------------------

    def get(self, conversion_id: str) -> Conversion:
        return self._history.get(conversion_id)

    def history(self) -> Iterator[Conversion]:
        """Newest first."""
        return self._history.newest_first()

    def active(self) -> list[Conversion]:
        """This router's conversions that hold a worker right now (the registry knows which;
        a worker may also be held by another replica's conversion)."""
        return [
            self._history.get(w.conversion_id)
            for w in self._registry.converting()
            if w.conversion_id is not None and w.conversion_id in self._history
        ]

    # --- commands ---------------------------------------------------------------------------

    async def start(self, request: ConversionRequest) -> Conversion:
        """Validate, claim the worker (DRAINING) and run the conversion in the background.

        Every refusal (409) happens before the worker's state changes. The checks and the claim
        are one synchronous step of the registry (after the only await, the protocol detection),
        so two conversions, or a conversion and a removal, cannot both pass.
        """
        worker = self._lookup(request.worker)
        try:
            extensions = await self._control.detect_extensions(worker)
        except ControlError as exc:
            raise WorkerUnreachable(exc) from exc
        if request.extra and not extensions:
            raise KnobNotAccepted(sorted(request.extra)[0], worker)
        await self._cluster.catch_up()
        conversion_id = self._cluster.conversion_id(self._started + 1)
        target = self._claim(worker, conversion_id, request.new_role)
        self._started += 1
        try:
            await self._cluster.claim(
                worker, conversion_id, target, lambda: self._refuse_below_minimum(worker)
            )
        except BaseException:
            self._registry.end_conversion(worker, conversion_id, WorkerState.ACTIVE)
            raise
        protocol = protocol_for(self._control, extensions, self._clock)
        conversion = Conversion(
            id=conversion_id,
            worker=worker,
            from_role=worker.role,
            to_role=target,
            request=request,
            protocol=protocol.name,
            replica=self._cluster.replica_id,
        )
        self._history.remember(conversion)
        conversion.phases.append(PhaseRecord("drain", time.time()))
        logger.info(
            "conversion %s: %s %s -> %s started by the %s (%s protocol)",
            conversion.id, worker.url, conversion.from_role, target, request.started_by,
            conversion.protocol,
        )  # fmt: skip
        task = asyncio.create_task(
            self._run(conversion, protocol), name=f"conversion-{conversion.id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return conversion

    def abort(self, conversion_id: str, why: str = "by the operator") -> Conversion:
        """Stop a conversion that is still draining; the worker goes back to its old pool."""
        conversion = self.get(conversion_id)
        if conversion.status is not Status.DRAINING:
            raise ConversionRefused(
                "not_abortable",
                f"conversion {conversion_id} is {conversion.status}; only a draining "
                "conversion can be aborted",
            )
        conversion.abort_reason = why
        conversion._abort.set()
        logger.info("conversion %s: abort requested %s", conversion_id, why)
        return conversion

    async def let_go(self, worker: Worker) -> bool:
        """``worker`` is leaving (discovery lost it): abort this router's conversion of it if
        it still drains, and return once that conversion ended; False when none of this
        router's conversions holds it."""
        if worker.conversion_id is None or worker.conversion_id not in self._history:
            return False
        conversion = self._history.get(worker.conversion_id)
        if conversion.status is Status.DRAINING:
            self.abort(conversion.id, "because the worker is leaving")
        await conversion.wait()
        return True

    def abort_draining(self, why: str) -> None:
        """Abort every conversion of this router that still drains (router shutdown): its
        worker goes back to its old pool with admission reopened. One whose switch call went
        out is not abortable: the worker switches whatever the router does next."""
        for conversion in self.active():
            if conversion.status is Status.DRAINING:
                self.abort(conversion.id, why)

    async def close(self, grace_secs: float = 0.0) -> None:
        """Router shutdown: abort the conversions still draining, wait up to ``grace_secs``
        for the others to end, then cancel what is left. Cancelling a conversion whose switch
        call went out would not stop the worker (it switches anyway, its own drain timeout
        bounding when), so the wait lets the record and the log say what happened; one still
        waiting for the worker's answer when the grace ends is recorded with its role
        unknown, never as back in a pool."""
        self.abort_draining("because the router is shutting down")
        # A conversion task cancelled before its first step would never run its own ending
        # (the record left draining, the worker held): one turn of the loop starts them all.
        await asyncio.sleep(0)
        tasks = list(self._tasks)
        if tasks and grace_secs > 0:
            await asyncio.wait(tasks, timeout=grace_secs)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- validation -------------------------------------------------------------------------

    def _lookup(self, key: str) -> Worker:
        try:
            return self._registry.get(key)
        except UnknownWorker as exc:
            raise ConversionRefused("unknown_worker", str(exc)) from exc

    def _claim(self, worker: Worker, conversion_id: str, new_role: Role | None) -> Role:
        """Have the registry hand ``worker`` to the conversion; returns the target role."""
        if not worker.role.disaggregated or new_role is Role.REGULAR:
            raise NotConvertible(worker)
        target = new_role or worker.role.other

        def check() -> None:
            if target is worker.role:
                raise AlreadyInRole(worker)
            self._refuse_if_unsafe(worker)

        try:
            self._registry.claim_for_conversion(worker, conversion_id, check)
        except RegistryError as exc:
            raise ConversionRefused(exc.reason, str(exc)) from exc
        return target

    def refusal(self, worker: Worker) -> str | None:
        """Why a conversion of ``worker`` would be refused whatever else runs (the worker
        cannot switch, or its pool would fall under its minimum); None if it would not be."""
        if not worker.role.disaggregated:
            return NotConvertible(worker).message
        try:
            self._refuse_switch_unsupported(worker)
            self._refuse_below_minimum(worker)
        except ConversionRefused as exc:
            return exc.message
        return None

    def _refuse_if_unsafe(self, worker: Worker) -> None:
        running = len(self._registry.converting())
        if running >= self._max_concurrent:
            raise ConversionRefused(
                "too_many_conversions",
                f"{running} conversion(s) running; the limit is {self._max_concurrent}",
            )
        self._refuse_switch_unsupported(worker)
        self._refuse_below_minimum(worker)

    @staticmethod
    def _refuse_switch_unsupported(worker: Worker) -> None:
        """A worker that said it cannot switch roles (its probes read it) would refuse the
        switch after its drain."""
        if worker.switch_supported is False:
            raise ConversionRefused(
                "switch_not_supported",
                f"{worker.url} cannot switch roles (launched without --enable-pd-role-switch)",
            )

    def _refuse_below_minimum(self, worker: Worker) -> None:
        """The worker's pool keeps its minimum of active, healthy workers without it."""
        minimum = self._minimum[worker.role]
        remaining = self._registry.remaining_below(worker, minimum)
        if remaining is not None:
            of_model = f" of {worker.model}" if len(self._registry.models()) > 1 else ""
            raise ConversionRefused(
                f"min_{worker.role.value}",
                f"converting {worker.url} would leave {remaining} active healthy "
                f"{worker.role} worker(s){of_model}; the minimum is {minimum}",
            )

    # --- the conversion ---------------------------------------------------------------------

    async def _run(self, conv: Conversion, protocol: ControlProtocol) -> None:
        deadline = self._clock() + (
            conv.request.drain_timeout_secs
            if conv.request.drain_timeout_secs is not None
            else self._drain_timeout
        )
        peer_params = asyncio.create_task(self._decode_peer_params(conv))
        try:
            await self._drain(conv, protocol, deadline)
            params = await self._peer_params(conv, peer_params)
            reply = await self._switch(conv, protocol, deadline, params)
            await self._verify(conv, protocol, reply)
        except Stop as stop:
            await self._stop(conv, protocol, stop)
        except asyncio.CancelledError:
            if conv.status is Status.DRAINING:
                await self._stop(
                    conv, protocol, Stop(Status.ABORTED, "router shutting down", restore=True)
                )
            else:
                self._interrupted(conv)
            raise
        except Exception as exc:
            # A bug must not leave the worker stuck out of every pool: before the switch call it
            # goes back (its role did not change), after it the role is unknown.
            logger.exception("conversion %s: unexpected error", conv.id)
            before_switch = conv.status is Status.DRAINING
            await self._stop(
                conv,
                protocol,
                Stop(
                    Status.RESTORED if before_switch else Status.FAILED,
                    f"internal error: {type(exc).__name__}",
                    restore=before_switch,
                ),
            )
        finally:
            peer_params.cancel()
            self._finish(conv)

    async def _drain(self, conv: Conversion, protocol: ControlProtocol, deadline: float) -> None:
        """Close admission (extension), then wait for the router's in-flight count to reach zero
        (event); abort and timeout end it. Whatever else the worker still runs (traffic from
        another router) is waited for by the switch itself: the extension's /convert_pd_role
        waits for idle on the server, a native "not idle" refusal is retried with a short
        backoff. Asking the worker first would put one more round trip between the last
        request ending and the switch."""
        conv.progress["router_inflight_at_start"] = conv.worker.inflight
        if conv.worker.picked_elsewhere:
            # Closed before every data plane took the worker out of selection, the worker's
            # admission would answer 503 to their picks meanwhile (each retried elsewhere).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    conv.worker.wait_until_unpicked(), max(0.0, deadline - self._clock())
                )
        await protocol.close_admission(conv)
        admission_closed = time.monotonic()
        if conv.request.drain:
            await self._wait_router_idle(conv, deadline)
            await self._wait_peers_idle(conv, deadline)
        # When the router's last request on the worker ended (or the worker's admission
        # closed, if that was later): now in one process; in a multi-process router, when the
        # last data plane's did, its report coming after.
        idle_at = conv.worker.idle_at
        conv.timings["router_idle_at"] = (
            max(idle_at, admission_closed) if idle_at is not None else time.monotonic()
        )
        conv.timings["drain_s"] = conv.phases[-1].end()
        logger.info("conversion %s: drained in %.3fs", conv.id, conv.timings["drain_s"])

    async def _wait_router_idle(self, conv: Conversion, deadline: float) -> None:
        idle = asyncio.ensure_future(conv.worker.wait_until_no_inflight())
        abort = asyncio.ensure_future(conv._abort.wait())
        try:
            await asyncio.wait(
                {idle, abort},
                timeout=max(0.0, deadline - self._clock()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            idle.cancel()
            abort.cancel()
        self._check_abort(conv)
        if not idle.done() or idle.cancelled():
            raise Stop(
                Status.DRAIN_TIMEOUT,
                f"drain timed out with {conv.worker.inflight} request(s) still in flight "
                "through this router",
                restore=True,
            )

    async def _wait_peers_idle(self, conv: Conversion, deadline: float) -> None:
        """Every other router replica stopped routing to the worker and has nothing left in
        flight on it (at once for a router alone)."""

        def waiting(replicas: list[str]) -> None:
            conv.progress["waiting_for_replicas"] = replicas

        try:
            missing = await self._cluster.wait_peers_drained(
                conv.worker, conv.id, conv._abort, deadline, waiting
            )
        except ConversionTaken as exc:
            raise Stop(Status.ABORTED, SETTLED_ELSEWHERE, restore=True) from exc
        self._check_abort(conv)
        if missing:
            raise Stop(
                Status.DRAIN_TIMEOUT,
                f"drain timed out: router replica(s) {', '.join(missing)} still have requests "
                "in flight on it",
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

    def _check_abort(self, conv: Conversion) -> None:
        if conv._abort.is_set():
            raise Stop(Status.ABORTED, f"aborted {conv.abort_reason} while draining", restore=True)

    async def _switch(
        self,
        conv: Conversion,
        protocol: ControlProtocol,
        deadline: float,
        peer_params: dict[str, Any],
    ) -> SwitchReply:
        phase = PhaseRecord("switch", time.time())
        conv.phases.append(phase)
        conv.status = Status.SWITCHING
        self._registry.advance_conversion(conv.worker, conv.id, WorkerState.SWITCHING)
        if not await self._cluster.mark_switching(conv.worker, conv.id):
            raise Stop(Status.ABORTED, SETTLED_ELSEWHERE, restore=True)
        body = self._switch_body(conv, peer_params)
        body.update(protocol.switch_fields(conv, deadline))
        conv.timings["idle_to_switch_s"] = time.monotonic() - conv.timings.pop("router_idle_at")
        reply, busy = await protocol.switch_until_idle(conv, body, deadline)
        conv.timings["switch_s"] = phase.end()
        if busy is not None:
            raise Stop(
                Status.DRAIN_TIMEOUT,
                f"drain timed out: the worker still has {busy.num_running} running and "
                f"{busy.num_waiting} waiting request(s)",
                restore=True,
            )
        if reply.success:
            logger.info("conversion %s: switched in %.3fs", conv.id, conv.timings["switch_s"])
            return reply
        if reply.safe_to_restore or refused_request(reply):
            raise Stop(
                Status.RESTORED,
                f"switch failed, worker unchanged: {reply.message}",
                restore=True,
            )
        raise Stop(
            Status.FAILED,
            f"switch failed without safe_to_restore: {reply.message}",
            restore=False,
        )

    def _switch_body(self, conv: Conversion, peer_params: dict[str, Any]) -> dict[str, Any]:
        """The role and the decode graph parameters: the caller's, else a decode peer's."""
        body: dict[str, Any] = {"new_role": conv.to_role.value}
        if conv.to_role is Role.DECODE:
            body.update(peer_params)
        body.update(_given_graph_params(conv))
        return body

    async def _verify(
        self, conv: Conversion, protocol: ControlProtocol, reply: SwitchReply
    ) -> None:
        phase = PhaseRecord("verify", time.time())
        conv.phases.append(phase)
        conv.status = Status.VERIFYING
        try:
            reading = await self._control.read_role(conv.worker)
        except ControlError as exc:
            raise Stop(
                Status.FAILED, f"could not read the role back: {exc.reason}", restore=False
            ) from exc
        conv.reply(
            "verify",
            200,
            {
                "role": reading.role.value if reading.role else None,
                "bootstrap_port": reading.bootstrap_port,
            },
        )
        if reading.role is not conv.to_role:
            raise Stop(
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
        if conv.to_role is Role.PREFILL:
            # SGLang's decodes keep the endpoints of the worker's previous run as a prefill:
            # they forget them before it takes traffic again (docs/sglang-bugs.md, bug b).
            await self._control.forget_prefill_on_decodes(conv.worker, port)
        await self._reopen(conv, protocol)
        await self._canary(conv, protocol, port)
        conv.timings["verify_s"] = phase.end()
        await self._cluster.release(conv.worker, conv.id, WorkerState.ACTIVE, conv.to_role, port)
        self._registry.end_conversion(
            conv.worker, conv.id, WorkerState.ACTIVE, role=conv.to_role, bootstrap_port=port
        )
        conv.epoch = conv.worker.epoch
        conv.bootstrap_port = conv.worker.bootstrap_port if port is not None else None
        conv.status = Status.SUCCEEDED
        conv.message = f"now a {conv.to_role} (epoch {conv.epoch})"
        for callback in self._succeeded:
            callback(conv.worker, conv.to_role)

    async def _reopen(self, conv: Conversion, protocol: ControlProtocol) -> None:
        try:
            await protocol.reopen_admission(conv)
        except ControlError as exc:
            logger.warning("conversion %s: could not reopen admission: %s", conv.id, exc)
            self._report_down(conv.worker, f"reopening admission failed: {exc}")

    async def _canary(self, conv: Conversion, protocol: ControlProtocol, port: int | None) -> None:
        """One real request through the worker in its new role before clients get it
        (:mod:`.canary`); a failed one switches the worker back to its old role, or leaves it
        FAILED when that does not work either."""
        if self._canary_timeout <= 0:
            return
        result = await run_canary(
            self._control, self._registry, conv.worker, conv.to_role, port, self._canary_timeout
        )
        conv.timings["canary_s"] = result.duration_s
        conv.reply("canary", 502 if result.failed else 200, result.as_dict())
        for peer, why in result.failures.items():
            logger.warning("conversion %s: canary with %s failed: %s", conv.id, peer, why)
        if not result.failed:
            return
        failures = "; ".join(result.failures.values())
        raise await self._switch_back(conv, protocol, f"canary failed ({failures})")

    async def _switch_back(self, conv: Conversion, protocol: ControlProtocol, why: str) -> Stop:
        """The worker switched but cannot serve in its new role: back to the old one. Returns
        how the conversion ends: RESTORED when the worker reports its old role again, FAILED
        when it does not."""
        old = conv.from_role
        forward = conv.timings.get("worker_switch_s")
        # The failed canary's requests may hold the worker busy a while (SGLang frees a failed
        # transfer's KV late): as long as a drain may take.
        deadline = self._clock() + self._drain_timeout
        body: dict[str, Any] = {"new_role": old.value}
        if old is Role.DECODE:
            # SGLang wants the decode graph parameters on a switch to decode (as forward).
            body.update(await self._decode_graph_params(conv))
            body.update(_given_graph_params(conv))
        try:
            reply, _ = await protocol.switch_until_idle(conv, body, deadline)
            reading = await self._control.read_role(conv.worker)
        except ControlError as exc:
            return Stop(Status.FAILED, f"{why}; switching back failed: {exc.reason}", restore=False)
        finally:
            conv.timings["switch_back_s"] = conv.timings.pop("worker_switch_s", 0.0)
            if forward is not None:
                conv.timings["worker_switch_s"] = forward
        conv.reply("switch_back", reply.status, reply.body)
        if not reply.success or reading.role is not old:
            return Stop(
                Status.FAILED,
                f"{why}; switching back to {old} did not take (it reports "
                f"{reading.role or 'no role'})",
                restore=False,
            )
        if old is Role.PREFILL:
            await self._control.forget_prefill_on_decodes(conv.worker, reading.bootstrap_port)
        return Stop(Status.RESTORED, f"{why}; switched back to {old}", restore=True)

    async def _stop(self, conv: Conversion, protocol: ControlProtocol, stop: Stop) -> None:
        conv.status = stop.status
        conv.message = stop.message
        for phase in conv.phases:
            if phase.ended_at is None:
                phase.end()
        worker = conv.worker
        if stop.restore:
            if stop.healthy:
                await self._reopen(conv, protocol)
            else:
                self._report_down(worker, stop.message)
            await self._cluster.release(worker, conv.id, WorkerState.ACTIVE, worker.role, None)
            self._registry.end_conversion(worker, conv.id, WorkerState.ACTIVE)
            logger.warning("conversion %s: %s; back in the %s pool", conv.id, stop, worker.role)
        else:
            await self._cluster.release(worker, conv.id, WorkerState.FAILED, worker.role, None)
            self._registry.end_conversion(worker, conv.id, WorkerState.FAILED, error=stop.message)
            logger.error("conversion %s: %s; worker %s FAILED", conv.id, stop, worker.url)

    def _interrupted(self, conv: Conversion) -> None:
        """The router stops with the switch call out and unanswered: the worker may switch
        still, so nothing is claimed about its role. The cluster record keeps the
        conversion, which another replica settles from the worker's live role once this
        replica's lease is gone (a router alone reads it again when it starts)."""
        step = "answered" if conv.status is Status.SWITCHING else "read back"
        conv.status = Status.FAILED
        conv.message = (
            f"router stopped before the switch to {conv.to_role} was {step}: "
            "the worker's role is unknown until read again"
        )
        for phase in conv.phases:
            if phase.ended_at is None:
                phase.end()
        self._registry.end_conversion(conv.worker, conv.id, WorkerState.FAILED, error=conv.message)
        logger.error("conversion %s: %s", conv.id, conv.message)

    def _finish(self, conv: Conversion) -> None:
        conv.finished_at = time.time()
        total = time.monotonic() - conv._t0
        conv.timings["total_s"] = total
        conv.timings.pop("router_idle_at", None)
        if conv.succeeded:
            conv.timings["router_overhead_s"] = (
                total - conv.timings["drain_s"] - conv.timings["worker_switch_s"]
            )
        self._history.record_finished(conv, total)
        if self._record_span is not None:
            self._record_span(conversion_span(conv))
        self._cluster.finished(conv.worker, conv.id)
        conv._done.set()
        logger.info("conversion %s: %s in %.3fs (%s)", conv.id, conv.status, total, conv.message)

    async def settle_orphan(self, worker: Worker, role: Role) -> tuple[Role, int | None]:
        """The role a worker serves now, for a conversion whose router replica went before it
        ended: its live role once any switch it still runs has ended, admission reopened;
        ``role``, the one it had, if it cannot be read (the health probes find out when it
        answers)."""
        try:
            reading = await self._control.read_role(worker)
            if reading.draining:
                await self._control.set_admission(worker, open_=True)
                reading = await self._after_running_conversion(worker)
        except ControlError as exc:
            logger.warning("settling %s: %s; keeping it as a %s", worker.url, exc, role)
            return role, None
        return reading.role or role, reading.bootstrap_port

    async def _after_running_conversion(self, worker: Worker) -> RoleReading:
        """The worker's reading once its own conversion ended. Still draining with admission
        reopened, it runs a ``/convert_pd_role`` the gone replica called, which drains and
        switches whoever waits for it: read too early, the role is the old one that the worker
        is about to leave. Waits up to the drain timeout (a worker whose switch failed unsafely
        drains for good; its role is then what it reports)."""
        deadline = self._clock() + self._drain_timeout
        pause = Backoff(SETTLE_POLL_FIRST_SECS, SETTLE_POLL_MAX_SECS)
        while True:
            reading = await self._control.read_role(worker)
            if not reading.draining or self._clock() + pause.secs > deadline:
                return reading
            await pause.sleep()

    async def _decode_peer_params(self, conv: Conversion) -> dict[str, Any]:
        """Decode graph parameters of a decode peer, fetched while the drain runs, for the ones
        the caller did not give (it may give one and take the other from the peer)."""
        given = (conv.request.decode_cuda_graph_bs, conv.request.decode_cuda_graph_memory_gb)
        if conv.to_role is not Role.DECODE or None not in given:
            return {}
        return await self._decode_graph_params(conv)

    async def _decode_graph_params(self, conv: Conversion) -> dict[str, Any]:
        """The first selectable decode peer's graph parameters ({} when none answers)."""
        for peer in self._registry.selectable(Role.DECODE):
            if peer is conv.worker:
                continue
            try:
                return await self._control.decode_graph_params(peer.url)
            except ControlError as exc:
                logger.info("conversion %s: decode peer %s: %s", conv.id, peer.url, exc)
        return {}


def _given_graph_params(conv: Conversion) -> dict[str, Any]:
    """The decode graph parameters the caller gave (they win over a peer's)."""
    request = conv.request
    given = {
        "decode_cuda_graph_bs": request.decode_cuda_graph_bs,
        "decode_cuda_graph_memory_gb": request.decode_cuda_graph_memory_gb,
    }
    return {name: value for name, value in given.items() if value is not None}


def _port(value: Any) -> int | None:
    return value if is_int(value) and value > 0 else None
