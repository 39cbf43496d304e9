"""Workers and the registry of the prefill and decode pools.

The registry is the one owner of worker lifecycle: role, state, epoch, health, the extension
protocol, the bootstrap port, which conversion holds a worker, and the router's in-flight count.
Everything else (policies, the request path, the conversion runner, the health monitor, the admin
API) reads workers and changes them only through the registry's methods, so every state change
goes through :data:`TRANSITIONS` and the metrics always follow the state. It knows nothing of
HTTP handlers.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from pd_router.control.circuit import (
    CIRCUIT_STATE_VALUES,
    CircuitBreaker,
    CircuitConfig,
    CircuitState,
)
from pd_router.control.load_report import LoadReport
from pd_router.metrics import RouterMetrics
from pd_router.roles import PD_ROLES, Role, bootstrap_host

logger = logging.getLogger(__name__)


class WorkerState(StrEnum):
    """A conversion: ACTIVE -> DRAINING -> SWITCHING -> ACTIVE (new role), DRAINING -> ACTIVE on
    abort, -> FAILED on an unsafe failure (out of every pool until re-added). A removal: ACTIVE or
    FAILED -> REMOVING (waiting for the router's in-flight requests) -> forgotten, or REMOVING ->
    ACTIVE when the cluster record whose going began it comes back. Only ACTIVE workers are
    selectable."""

    ACTIVE = "active"
    DRAINING = "draining"
    SWITCHING = "switching"
    FAILED = "failed"
    REMOVING = "removing"


TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.ACTIVE: frozenset({WorkerState.DRAINING, WorkerState.REMOVING}),
    WorkerState.DRAINING: frozenset(
        {WorkerState.ACTIVE, WorkerState.SWITCHING, WorkerState.FAILED}
    ),
    WorkerState.SWITCHING: frozenset({WorkerState.ACTIVE, WorkerState.FAILED}),
    WorkerState.FAILED: frozenset({WorkerState.ACTIVE, WorkerState.REMOVING}),
    WorkerState.REMOVING: frozenset({WorkerState.ACTIVE}),
}

# The states in which a conversion holds the worker (and only those).
CONVERTING = frozenset({WorkerState.DRAINING, WorkerState.SWITCHING})


class Unavailability(StrEnum):
    """Why a worker stopped taking requests, as :meth:`WorkerRegistry.on_unavailable` reports it."""

    UNHEALTHY = "unhealthy"
    FAILED = "failed"
    REMOVED = "removed"


class RegistryError(Exception):
    """Base of the registry's refusals; ``reason`` is a stable code for scripts."""

    reason = "conflict"


class UnknownWorker(RegistryError):
    reason = "unknown_worker"

    def __init__(self, key: str) -> None:
        super().__init__(f"no worker with url or id {key!r}")
        self.key = key


class DuplicateWorker(RegistryError):
    reason = "duplicate_worker"

    def __init__(self, url: str) -> None:
        super().__init__(f"worker {url} is already registered")
        self.url = url


class InvalidTransition(RegistryError):
    reason = "not_active"

    def __init__(self, worker: Worker, target: WorkerState) -> None:
        super().__init__(f"worker {worker.url} cannot go from {worker.state} to {target}")
        self.worker = worker
        self.target = target


class WorkerConverting(RegistryError):
    """A conversion holds the worker: nothing else may change its state."""

    reason = "already_converting"

    def __init__(self, worker: Worker) -> None:
        super().__init__(
            f"worker {worker.url} is {worker.state} for conversion {worker.conversion_id}"
        )
        self.worker = worker


class WorkerRemoving(RegistryError):
    """The worker is being removed: it only waits for its in-flight requests now."""

    reason = "removing"

    def __init__(self, worker: Worker) -> None:
        super().__init__(f"worker {worker.url} is being removed")
        self.worker = worker


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash; a bare ``host:port`` gets ``http://``."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) worker url: {url!r}")
    if parts.port is None and ":" in parts.netloc.rsplit("]", 1)[-1]:
        raise ValueError(f"bad port in worker url: {url!r}")
    return url


@dataclass(frozen=True)
class Origin:
    """Where discovery found a worker: a pod (``name`` in ``namespace``) or a manifest entry
    (its id), with the model id its metadata names."""

    provider: str
    name: str
    namespace: str | None = None
    model_id: str | None = None

    def as_dict(self) -> dict[str, str]:
        out = {"provider": self.provider, "pod" if self.namespace else "id": self.name}
        if self.namespace:
            out["namespace"] = self.namespace
        if self.model_id:
            out["model_id"] = self.model_id
        return out

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.name}" if self.namespace else f"entry {self.name}"


@dataclass(eq=False)
class Worker:
    """One SGLang (or reference) server as the router sees it."""

    id: str
    url: str
    role: Role
    bootstrap_port: int | None
    circuit: CircuitBreaker
    state: WorkerState = WorkerState.ACTIVE
    epoch: int = 0
    healthy: bool = True
    # False while the worker's own admission is closed by someone else (another router draining
    # it): it keeps its in-flight requests and its health, but gets no new ones.
    admitting: bool = True
    inflight: int = 0
    # When the in-flight count last fell to zero in a data plane (monotonic; set from the data
    # planes' reports, None before the first).
    idle_at: float | None = None
    has_extensions: bool | None = None
    # Whether the worker can switch roles (None: it has not said yet).
    switch_supported: bool | None = None
    last_error: str | None = None
    conversion_id: str | None = None
    # Set when discovery found the worker (its pod or manifest entry).
    origin: Origin | None = None
    bootstrap_host: str = ""
    # The model it serves: given (configuration, discovery) or read from its /server_info
    # (``served_model_name``, else ``model_path``); None until known, "" when it names none.
    model: str | None = None
    # The worker's last report of its own load (None: none, or it stopped answering); kept
    # only while a policy needs it (:mod:`pd_router.control.load_poller`).
    load_report: LoadReport | None = None
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # Set while no data plane of this router may pick the worker unless it is selectable
    # here: cleared from its leaving selection until every data plane acked the snapshot that
    # says so.
    _unpicked: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # The worker_inflight{worker,role} child for the current role, so the hot path does no
    # label lookup per request.
    _inflight_gauge: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.bootstrap_host = bootstrap_host(self.url)
        self._idle.set()
        self._unpicked.set()

    @property
    def model_name(self) -> str:
        """The model it serves ("" when not known)."""
        return self.model or ""

    @property
    def selectable(self) -> bool:
        return (
            self.state is WorkerState.ACTIVE
            and self.healthy
            and self.admitting
            and self.circuit.allows()
        )

    async def wait_until_no_inflight(self) -> None:
        """Return once the router has no request in flight on this worker (event-driven)."""
        await self._idle.wait()

    @property
    def picked_elsewhere(self) -> bool:
        """Whether a data plane may still pick this worker though it left selection."""
        return not self._unpicked.is_set()

    async def wait_until_unpicked(self) -> None:
        """Return once no data plane may pick this worker any more."""
        await self._unpicked.wait()

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role.value,
            "model": self.model,
            "bootstrap_port": self.bootstrap_port,
            "state": self.state.value,
            "epoch": self.epoch,
            "healthy": self.healthy,
            "admitting": self.admitting,
            "inflight": self.inflight,
            "circuit": self.circuit.state.value,
            "has_extensions": self.has_extensions,
            "switch_supported": self.switch_supported,
            "last_error": self.last_error,
            "conversion": self.conversion_id,
            "origin": self.origin.as_dict() if self.origin is not None else None,
            "reported_load": (self.load_report.as_dict() if self.load_report is not None else None),
        }


UnavailableCallback = Callable[[Worker, Unavailability], None]


class WorkerRegistry:
    """The prefill and decode pools: the single owner of worker lifecycle.

    Membership, state, role, epoch, health and which conversion holds a worker change only here.
    A conversion claims a worker (:meth:`claim_for_conversion`), moves it on
    (:meth:`advance_conversion`) and hands it back (:meth:`end_conversion`); a removal marks it
    REMOVING (:meth:`begin_removal`) and then forgets it (:meth:`forget`). Each is one
    synchronous step, so two actors cannot both pass a check before either acts.
    """

    def __init__(self, metrics: RouterMetrics, circuit_config: CircuitConfig | None = None) -> None:
        self._metrics = metrics
        self._circuit_config = circuit_config or CircuitConfig()
        self._by_url: dict[str, Worker] = {}
        self._by_id: dict[str, Worker] = {}
        self._ids = itertools.count(1)
        self._unavailable_callbacks: list[UnavailableCallback] = []
        self._adopted_callbacks: list[Callable[[Worker], None]] = []
        self._left_pool_callbacks: list[Callable[[Worker, Role], None]] = []
        self._changed_callbacks: list[Callable[[], None]] = []
        self._load_callbacks: list[Callable[[], None]] = []
        for role in Role:
            self._metrics.pool_size.labels(role.value).set(0)

    # --- membership -------------------------------------------------------------------------

    def add(
        self,
        url: str,
        role: Role,
        bootstrap_port: int | None = None,
        *,
        healthy: bool = True,
        model: str | None = None,
    ) -> Worker:
        """Register a worker as ACTIVE in ``role``, serving ``model`` (None: read from the
        worker by the health monitor). A known url raises DuplicateWorker (or WorkerRemoving
        until its removal ends), except a FAILED worker, which an operator re-adds this way (it
        comes back under ``role``)."""
        url = normalize_url(url)
        self.check_addable(url)
        existing = self._by_url.get(url)
        if existing is not None:
            existing.circuit.reset()
            existing.last_error = None
            if model is not None:
                self.set_model(existing, model)
            self.set_health(existing, healthy)
            self._move(existing, WorkerState.ACTIVE, role=role, bootstrap_port=bootstrap_port)
            return existing
        worker_id = f"w{next(self._ids)}"
        worker = Worker(
            id=worker_id,
            url=url,
            role=role,
            bootstrap_port=bootstrap_port,
            circuit=CircuitBreaker(
                self._circuit_config, on_change=functools.partial(self._on_circuit, url)
            ),
            healthy=healthy,
            model=model,
        )
        self._by_url[url] = worker
        self._by_id[worker_id] = worker
        worker._inflight_gauge = self._metrics.worker_inflight.labels(url, role.value)
        worker._inflight_gauge.set(0)
        self._metrics.worker_healthy.labels(url).set(1 if healthy else 0)
        self._metrics.circuit_state.labels(url).set(0)
        if model is not None:
            self._metrics.worker_model.labels(url, model).set(1)
        self._export_state(worker)
        self._export_pools()
        self._tell_changed()
        return worker

    def check_addable(self, url: str) -> None:
        """Raise what :meth:`add` would refuse ``url`` with (DuplicateWorker, WorkerRemoving),
        changing nothing."""
        existing = self._by_url.get(normalize_url(url))
        if existing is not None:
            if existing.state is WorkerState.REMOVING:
                raise WorkerRemoving(existing)
            if existing.state is not WorkerState.FAILED:
                raise DuplicateWorker(existing.url)

    def check_removable(self, worker: Worker) -> None:
        """Raise what :meth:`begin_removal` would refuse with, changing nothing (to ask the
        other router replicas only about a removal this one allows)."""
        self._require_free(worker)

    def begin_removal(self, worker: Worker) -> None:
        """ACTIVE or FAILED -> REMOVING: out of every pool at once, the in-flight requests left
        to finish. Refused (WorkerConverting, WorkerRemoving) while a conversion holds the
        worker or another removal runs, so a removal and a conversion never both start."""
        self._require_free(worker)
        self._move(worker, WorkerState.REMOVING)

    def readmit(self, worker: Worker) -> None:
        """REMOVING -> ACTIVE: a removal that began because the worker's cluster record went is
        called off, the record being back. Its in-flight requests never stopped."""
        self._require_registered(worker)
        if worker.state is not WorkerState.REMOVING:
            raise InvalidTransition(worker, WorkerState.ACTIVE)
        self._move(worker, WorkerState.ACTIVE)

    def forget(self, worker: Worker) -> None:
        """Drop a REMOVING worker and its metric series (the end of a removal)."""
        self._require_registered(worker)
        if worker.state is not WorkerState.REMOVING:
            raise InvalidTransition(worker, WorkerState.REMOVING)
        del self._by_url[worker.url]
        del self._by_id[worker.id]
        self._metrics.forget_worker(
            worker.url, worker.role.value, [s.value for s in WorkerState], worker.model
        )
        self._export_pools()
        self._tell_changed()
        self._tell_unavailable(worker, Unavailability.REMOVED)
        self._tell_left_pool(worker, worker.role)

    def get(self, key: str) -> Worker:
        """Look a worker up by id (``w3``) or url (with or without a trailing slash). A url
        exactly as stored is found without parsing it: the data planes' reports name each
        worker of every leg that way, thousands of times a second."""
        worker = self._by_id.get(key) or self._by_url.get(key)
        if worker is not None:
            return worker
        try:
            worker = self._by_url.get(normalize_url(key))
        except ValueError:
            worker = None
        if worker is None:
            raise UnknownWorker(key)
        return worker

    def registered(self, worker: Worker) -> bool:
        """Whether ``worker`` is still in the registry (not forgotten since it was looked up)."""
        return self._by_url.get(worker.url) is worker

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    # --- views ------------------------------------------------------------------------------

    def in_role(
        self,
        role: Role,
        states: Iterable[WorkerState] | None = None,
        model: str | None = None,
    ) -> list[Worker]:
        """The workers of ``role`` (in ``states``; of ``model`` when given)."""
        wanted = frozenset(states) if states is not None else None
        return [
            w
            for w in self._by_url.values()
            if w.role is role
            and (wanted is None or w.state in wanted)
            and (model is None or w.model_name == model)
        ]

    def selectable(self, role: Role, model: str | None = None) -> list[Worker]:
        """ACTIVE, healthy workers of ``role`` (of ``model`` when given) whose circuit lets a
        request through."""
        return [
            w
            for w in self._by_url.values()
            if w.role is role and w.selectable and (model is None or w.model_name == model)
        ]

    def roles(self) -> tuple[Role, ...]:
        """The pools a listing shows: prefill and decode always, regular once a regular worker
        is registered."""
        if any(w.role is Role.REGULAR for w in self._by_url.values()):
            return tuple(Role)
        return PD_ROLES

    def models(self) -> list[str]:
        """The models the workers name, in order of registration; [""] when workers name none
        (or are not read yet), [] without workers. A worker not read yet is no model of its
        own, as on the request path."""
        named = list(dict.fromkeys(w.model for w in self._by_url.values() if w.model))
        if named:
            return named
        return [""] if self._by_url else []

    def remaining_below(self, worker: Worker, minimum: int) -> int | None:
        """How many active healthy workers ``worker``'s pool (its role, its model) keeps
        without it, when that is fewer than ``minimum`` (None: the pool keeps its minimum)."""
        remaining = self.active_healthy_count(
            worker.role, excluding=worker, model=worker.model_name
        )
        return remaining if remaining < minimum else None

    def active_healthy_count(
        self, role: Role, excluding: Worker | None = None, model: str | None = None
    ) -> int:
        """ACTIVE, healthy, admitting workers of ``role`` (of ``model`` when given)."""
        return sum(
            1
            for w in self._by_url.values()
            if w.role is role
            and w.state is WorkerState.ACTIVE
            and w.healthy
            and w.admitting
            and w is not excluding
            and (model is None or w.model_name == model)
        )

    def converting(self) -> list[Worker]:
        """The workers a conversion holds (DRAINING or SWITCHING)."""
        return [w for w in self._by_url.values() if w.conversion_id is not None]

    # --- conversions ------------------------------------------------------------------------

    def claim_for_conversion(
        self, worker: Worker, conversion_id: str, check: Callable[[], None]
    ) -> None:
        """Hand an ACTIVE worker to conversion ``conversion_id`` and move it to DRAINING.

        Refused before anything changes: UnknownWorker (removed meanwhile), WorkerConverting,
        WorkerRemoving, InvalidTransition (not ACTIVE); then ``check`` runs, the caller's own
        policy (target role, pool minimum, cap on conversions), which raises to refuse. No await
        happens between the checks and the claim, so two claims or a claim and a removal cannot
        both pass.
        """
        self._require_free(worker)
        if worker.state is not WorkerState.ACTIVE:
            raise InvalidTransition(worker, WorkerState.DRAINING)
        check()
        worker.conversion_id = conversion_id
        self._move(worker, WorkerState.DRAINING)

    def advance_conversion(self, worker: Worker, conversion_id: str, state: WorkerState) -> None:
        """Move a worker the conversion holds to another converting state (DRAINING ->
        SWITCHING)."""
        self._require_holder(worker, conversion_id)
        if state not in CONVERTING:
            raise InvalidTransition(worker, state)
        self._move(worker, state)

    def end_conversion(
        self,
        worker: Worker,
        conversion_id: str,
        state: WorkerState,
        *,
        role: Role | None = None,
        bootstrap_port: int | None = None,
        error: str | None = None,
    ) -> None:
        """The conversion lets the worker go: ACTIVE (under ``role`` when it changed, epoch + 1)
        or FAILED (with ``error`` as its last error)."""
        self._require_holder(worker, conversion_id)
        if state in CONVERTING:
            raise InvalidTransition(worker, state)
        if error is not None:
            worker.last_error = error
        worker.conversion_id = None
        self._move(worker, state, role=role, bootstrap_port=bootstrap_port)

    # --- what probes learn ------------------------------------------------------------------
    # A probe may answer after its worker was forgotten; what it learnt is then dropped, so a
    # removed worker's series never come back.

    def set_health(self, worker: Worker, healthy: bool, error: str | None = None) -> None:
        if not self.registered(worker):
            return
        if error is not None:
            worker.last_error = error
        if worker.healthy is healthy:
            return
        worker.healthy = healthy
        self._metrics.worker_healthy.labels(worker.url).set(1 if healthy else 0)
        self._tell_changed()
        if not healthy:
            self._tell_unavailable(worker, Unavailability.UNHEALTHY)

    def note_error(self, worker: Worker, error: str) -> None:
        """Keep ``error`` as the worker's last error (shown in ``/workers``)."""
        if self.registered(worker):
            worker.last_error = error

    def clear_error(self, worker: Worker) -> None:
        """The worker answers again: its last error is history, not its state."""
        if self.registered(worker):
            worker.last_error = None

    def set_switch_supported(self, worker: Worker, supported: bool) -> None:
        """Whether the worker reported it can switch roles."""
        if self.registered(worker):
            worker.switch_supported = supported

    def set_bootstrap_port(self, worker: Worker, port: int) -> None:
        """The KV bootstrap port a prefill reported for itself."""
        if self.registered(worker) and worker.bootstrap_port != port:
            worker.bootstrap_port = port
            self._tell_changed()

    def set_extensions(self, worker: Worker, has_extensions: bool | None) -> None:
        """Whether the worker serves the extension endpoints; None: unknown, detect again (a
        restarted process may be another build)."""
        if self.registered(worker):
            worker.has_extensions = has_extensions

    def set_model(self, worker: Worker, model: str) -> None:
        """The model the worker serves, as read from it or given for it."""
        if worker.model != model:
            if worker.model is not None:
                self._metrics.worker_model.remove(worker.url, worker.model)
            worker.model = model
            self._metrics.worker_model.labels(worker.url, model).set(1)
            self._export_pools()
            self._tell_changed()

    def set_origin(self, worker: Worker, origin: Origin) -> None:
        """Where discovery found the worker (shown with it)."""
        if self.registered(worker):
            worker.origin = origin

    def set_admitting(self, worker: Worker, admitting: bool) -> None:
        """Whether the worker admits new requests. A worker that another router or an operator
        drains (its admission closed) is out of selection and of the pool minimums, but stays
        healthy: its in-flight requests are left to finish."""
        if not self.registered(worker) or worker.admitting is admitting:
            return
        worker.admitting = admitting
        self._tell_changed()

    def mark_recovered(self, worker: Worker) -> None:
        """The probes saw the worker recover: healthy, with a closed circuit (the failures it
        counted were the outage the probes saw)."""
        if not self.registered(worker):
            return
        worker.circuit.reset()
        worker.last_error = None
        self.set_health(worker, True)

    def note_restart(self, worker: Worker, *, forget_protocol: bool) -> None:
        """The worker is another process than before: failures of the old one say nothing of
        it (closed circuit) and, with ``forget_protocol``, whether it has the extension routes
        is detected again."""
        if not self.registered(worker):
            return
        worker.circuit.reset()
        if forget_protocol:
            worker.has_extensions = None

    def adopt_role(self, worker: Worker, role: Role, bootstrap_port: int | None = None) -> None:
        """Move an ACTIVE worker that no conversion holds to the pool of ``role`` (epoch + 1):
        its live role changed outside this router (a restart, another router)."""
        self._require_free(worker)
        if worker.state is not WorkerState.ACTIVE:
            raise InvalidTransition(worker, WorkerState.ACTIVE)
        self._move(worker, WorkerState.ACTIVE, role=role, bootstrap_port=bootstrap_port)
        for callback in list(self._adopted_callbacks):
            callback(worker)

    # --- what other router replicas decided -------------------------------------------------
    # A cluster of replicas shares each worker's role, state, epoch and holding conversion
    # (pd_router.cluster); these apply what another replica published. Health, circuits and
    # in-flight counts stay this replica's own.

    def hold_for_peer(self, worker: Worker, conversion_id: str, state: WorkerState) -> None:
        """A conversion another replica runs holds ``worker`` (DRAINING, then SWITCHING): out
        of selection here too, its in-flight requests left to finish."""
        self._require_registered(worker)
        if worker.conversion_id not in (None, conversion_id):
            raise WorkerConverting(worker)
        if worker.state is WorkerState.REMOVING:
            raise WorkerRemoving(worker)
        if state not in CONVERTING:
            raise InvalidTransition(worker, state)
        if worker.state is WorkerState.ACTIVE and state is WorkerState.SWITCHING:
            self._move(worker, WorkerState.DRAINING)
        worker.conversion_id = conversion_id
        self._move(worker, state)

    def release_from_peer(
        self,
        worker: Worker,
        conversion_id: str,
        state: WorkerState,
        *,
        role: Role,
        bootstrap_port: int | None,
        epoch: int,
    ) -> None:
        """Another replica's conversion let the worker go: ACTIVE or FAILED, under ``role``."""
        self._require_holder(worker, conversion_id)
        if state in CONVERTING:
            raise InvalidTransition(worker, state)
        worker.conversion_id = None
        self._move(worker, state, role=role, bootstrap_port=bootstrap_port, epoch=epoch)

    def follow_peer(
        self, worker: Worker, *, role: Role, bootstrap_port: int | None, epoch: int
    ) -> None:
        """The shared record of a worker no conversion holds names another role, port or
        epoch (another replica saw its role change): take them over."""
        self._require_free(worker)
        self._move(worker, worker.state, role=role, bootstrap_port=bootstrap_port, epoch=epoch)

    def on_adopted(self, callback: Callable[[Worker], None]) -> None:
        """Call ``callback(worker)`` after :meth:`adopt_role` moved a worker to another pool
        (a role change this replica's probes found), so a cluster can share it."""
        self._adopted_callbacks.append(callback)

    # --- in-flight accounting (from the data planes' reports) -------------------------------

    def set_picked_elsewhere(self, worker: Worker, picked: bool) -> None:
        """Whether a data plane may still pick ``worker``, which left selection, because it
        has not acked the snapshot that says so."""
        if picked:
            worker._unpicked.clear()
        else:
            worker._unpicked.set()

    def set_inflight(self, worker: Worker, count: int, idle_at: float) -> None:
        """The in-flight count the data planes report in sum
        (:mod:`pd_router.control.publisher`); ``idle_at``: when the last of them became idle
        on the worker, for a count of zero."""
        worker.inflight = count
        worker._inflight_gauge.set(count)
        if count <= 0:
            worker.idle_at = idle_at
            worker._idle.set()
        else:
            worker._idle.clear()

    # --- what the workers report about their own load --------------------------------------

    def set_load_report(self, worker: Worker, report: LoadReport | None) -> None:
        """The worker's latest report of its own load (None: it has none now), whoever read
        it: the poller, or a feed the engine pushes. A report for a worker forgotten meanwhile
        is dropped."""
        if not self.registered(worker) or worker.load_report is report:
            return
        worker.load_report = report
        for callback in self._load_callbacks:
            callback()

    def on_load_report(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after a worker's load report changed (not a snapshot change:
        reports come far more often than the pools change). It must not block."""
        self._load_callbacks.append(callback)

    # --- unavailability listeners -----------------------------------------------------------

    def on_unavailable(self, callback: UnavailableCallback) -> None:
        """Call ``callback(worker, why)`` whenever a worker stops taking requests for good or
        for a while: it turns unhealthy, FAILED, or is forgotten after a removal, so the request
        path can end the legs still running on it. Not called at DRAINING or REMOVING, whose
        point is to let in-flight requests finish. Called after the registry changed, from the
        code that changed it: a callback must not block."""
        self._unavailable_callbacks.append(callback)

    def on_left_pool(self, callback: Callable[[Worker, Role], None]) -> None:
        """Call ``callback(worker, role)`` when a worker leaves the pool of ``role`` for good
        (forgotten after a removal, or moved to the other role), so what was kept about it
        for that pool (a cache-aware policy's prefixes) goes too."""
        self._left_pool_callbacks.append(callback)

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after any change a data plane routes by: membership, role,
        state, health, admission, bootstrap port, circuit (the data planes get a new snapshot
        then). Called from the code that made the change: it must not block."""
        self._changed_callbacks.append(callback)

    def _tell_changed(self) -> None:
        for callback in self._changed_callbacks:
            callback()

    def _tell_left_pool(self, worker: Worker, role: Role) -> None:
        for callback in list(self._left_pool_callbacks):
            callback(worker, role)

    def _tell_unavailable(self, worker: Worker, why: Unavailability) -> None:
        for callback in list(self._unavailable_callbacks):
            try:
                callback(worker, why)
            except Exception:
                # The state change has happened; a failing listener must not undo it for the
                # caller (a conversion, the health monitor) or keep the others from hearing.
                logger.exception("on_unavailable callback failed for %s (%s)", worker.url, why)

    # --- the transition table ---------------------------------------------------------------

    def _require_registered(self, worker: Worker) -> None:
        if not self.registered(worker):
            raise UnknownWorker(worker.url)

    def _require_free(self, worker: Worker) -> None:
        """Registered, held by no conversion, not being removed."""
        self._require_registered(worker)
        if worker.conversion_id is not None:
            raise WorkerConverting(worker)
        if worker.state is WorkerState.REMOVING:
            raise WorkerRemoving(worker)

    def _require_holder(self, worker: Worker, conversion_id: str) -> None:
        self._require_registered(worker)
        if worker.conversion_id != conversion_id:
            raise WorkerConverting(worker)

    def _move(
        self,
        worker: Worker,
        state: WorkerState,
        *,
        role: Role | None = None,
        bootstrap_port: int | None = None,
        epoch: int | None = None,
    ) -> None:
        """The one place a worker's state changes; a new ``role`` bumps its epoch (to ``epoch``
        when the cluster's shared record says which)."""
        if state is not worker.state and state not in TRANSITIONS[worker.state]:
            raise InvalidTransition(worker, state)
        left = None
        if role is not None and role is not worker.role:
            self._metrics.worker_inflight.remove(worker.url, worker.role.value)
            left = worker.role
            worker.role = role
            worker.epoch += 1
            # Failures seen under the old role (e.g. 503s from its closed admission while it
            # drained) say nothing about the worker under its new one.
            worker.circuit.reset()
            worker._inflight_gauge = self._metrics.worker_inflight.labels(worker.url, role.value)
            worker._inflight_gauge.set(worker.inflight)
        if bootstrap_port is not None:
            worker.bootstrap_port = bootstrap_port
        if epoch is not None:
            worker.epoch = epoch
        worker.state = state
        self._export_state(worker)
        self._export_pools()
        self._tell_changed()
        if state is WorkerState.FAILED:
            self._tell_unavailable(worker, Unavailability.FAILED)
        if left is not None:
            self._tell_left_pool(worker, left)

    # --- metrics ----------------------------------------------------------------------------

    def _on_circuit(self, url: str, state: CircuitState) -> None:
        """Export a circuit's new state and say so in the log (a warning when it opens or
        closes: the worker leaves or rejoins selection). A leg still running on a forgotten
        worker may move its circuit: no series comes back."""
        if url not in self._by_url:
            return
        self._metrics.circuit_state.labels(url).set(CIRCUIT_STATE_VALUES[state])
        level = logging.INFO if state is CircuitState.HALF_OPEN else logging.WARNING
        logger.log(level, "worker %s circuit %s", url, state.value, extra={"worker": url})
        self._tell_changed()

    def _export_state(self, worker: Worker) -> None:
        for state in WorkerState:
            self._metrics.worker_state.labels(worker.url, state.value).set(
                1 if worker.state is state else 0
            )

    def _export_pools(self) -> None:
        """``pool_size`` per role, and ``model_pool_size`` per model and role (a worker not
        read yet in neither model's)."""
        active = [w for w in self._by_url.values() if w.state is WorkerState.ACTIVE]
        for role in Role:
            self._metrics.pool_size.labels(role.value).set(sum(1 for w in active if w.role is role))
        sizes = {(model, role): 0 for model in self.models() for role in Role}
        for w in active:
            key = (w.model_name, w.role)
            if key in sizes:
                sizes[key] += 1
        self._metrics.model_pool_size.clear()
        for (model, role), size in sizes.items():
            self._metrics.model_pool_size.labels(model, role.value).set(size)
