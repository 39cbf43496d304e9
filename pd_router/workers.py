"""Workers and the registry of the prefill and decode pools.

The registry is the one place where worker state lives: role, state, epoch, health, circuit and
the router's in-flight count. Everything else (policies, the request path, the conversion
manager, the health monitor, the admin API) asks it and changes state only through it, so the
metrics always follow the state. It knows nothing of HTTP handlers.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from pd_router.circuit import CIRCUIT_STATE_VALUES, CircuitBreaker, CircuitConfig, CircuitState
from pd_router.metrics import RouterMetrics

DEFAULT_BOOTSTRAP_PORT = 8998


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def other(self) -> Role:
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


class WorkerState(StrEnum):
    """ACTIVE -> DRAINING -> SWITCHING -> ACTIVE (new role); DRAINING -> ACTIVE on abort;
    SWITCHING -> FAILED on an unsafe failure. Only ACTIVE workers are selectable."""

    ACTIVE = "active"
    DRAINING = "draining"
    SWITCHING = "switching"
    FAILED = "failed"


ALLOWED_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.ACTIVE: frozenset({WorkerState.DRAINING, WorkerState.FAILED}),
    WorkerState.DRAINING: frozenset(
        {WorkerState.ACTIVE, WorkerState.SWITCHING, WorkerState.FAILED}
    ),
    WorkerState.SWITCHING: frozenset({WorkerState.ACTIVE, WorkerState.FAILED}),
    WorkerState.FAILED: frozenset({WorkerState.ACTIVE}),
}


class RegistryError(Exception):
    """Base of the registry's refusals; the server maps each to a status code."""


class UnknownWorker(RegistryError):
    def __init__(self, key: str) -> None:
        super().__init__(f"no worker with url or id {key!r}")
        self.key = key


class DuplicateWorker(RegistryError):
    def __init__(self, url: str) -> None:
        super().__init__(f"worker {url} is already registered")
        self.url = url


class InvalidTransition(RegistryError):
    def __init__(self, worker: Worker, target: WorkerState) -> None:
        super().__init__(f"worker {worker.url} cannot go from {worker.state} to {target}")
        self.worker = worker
        self.target = target


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


def bootstrap_host(url: str) -> str:
    """The host part of a worker url as SGLang's decode wants it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


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
    inflight: int = 0
    has_extensions: bool | None = None
    last_error: str | None = None
    bootstrap_host: str = ""
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # The worker_inflight{worker,role} child for the current role, so the hot path does no
    # label lookup per request.
    _inflight_gauge: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.bootstrap_host = bootstrap_host(self.url)
        self._idle.set()

    @property
    def selectable(self) -> bool:
        return self.state is WorkerState.ACTIVE and self.healthy and self.circuit.allows()

    async def wait_until_no_inflight(self) -> None:
        """Return once the router has no request in flight on this worker (event-driven)."""
        await self._idle.wait()

    def as_dict(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role.value,
            "bootstrap_port": self.bootstrap_port,
            "state": self.state.value,
            "epoch": self.epoch,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "circuit": self.circuit.state.value,
            "has_extensions": self.has_extensions,
            "last_error": self.last_error,
        }


class WorkerRegistry:
    """The prefill and decode pools: the single owner of worker state."""

    def __init__(self, metrics: RouterMetrics, circuit_config: CircuitConfig | None = None) -> None:
        self._metrics = metrics
        self._circuit_config = circuit_config or CircuitConfig()
        self._by_url: dict[str, Worker] = {}
        self._by_id: dict[str, Worker] = {}
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
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
    ) -> Worker:
        """Register a worker as ACTIVE in ``role``. A known url raises DuplicateWorker, except a
        FAILED worker, which an operator re-adds this way (it comes back under ``role``)."""
        url = normalize_url(url)
        existing = self._by_url.get(url)
        if existing is not None:
            if existing.state is not WorkerState.FAILED:
                raise DuplicateWorker(url)
            existing.circuit.reset()
            existing.last_error = None
            self.set_health(existing, healthy)
            self.set_state(existing, WorkerState.ACTIVE, role=role, bootstrap_port=bootstrap_port)
            return existing
        worker_id = f"w{next(self._ids)}"
        worker = Worker(
            id=worker_id,
            url=url,
            role=role,
            bootstrap_port=bootstrap_port,
            circuit=CircuitBreaker(
                self._circuit_config, on_change=lambda s, u=url: self._on_circuit(u, s)
            ),
            healthy=healthy,
        )
        self._by_url[url] = worker
        self._by_id[worker_id] = worker
        worker._inflight_gauge = self._metrics.worker_inflight.labels(url, role.value)
        worker._inflight_gauge.set(0)
        self._metrics.worker_healthy.labels(url).set(1 if healthy else 0)
        self._metrics.circuit_state.labels(url).set(0)
        self._export_state(worker)
        self._export_pools()
        self._notify()
        return worker

    def remove(self, worker: Worker) -> None:
        self._by_url.pop(worker.url, None)
        self._by_id.pop(worker.id, None)
        self._metrics.forget_worker(worker.url, worker.role.value)
        self._export_pools()
        self._notify()

    def get(self, key: str) -> Worker:
        """Look a worker up by id (``w3``) or url (with or without a trailing slash)."""
        worker = self._by_id.get(key)
        if worker is not None:
            return worker
        try:
            worker = self._by_url.get(normalize_url(key))
        except ValueError:
            worker = None
        if worker is None:
            raise UnknownWorker(key)
        return worker

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    # --- views ------------------------------------------------------------------------------

    def in_role(self, role: Role, states: Iterable[WorkerState] | None = None) -> list[Worker]:
        wanted = frozenset(states) if states is not None else None
        return [
            w
            for w in self._by_url.values()
            if w.role is role and (wanted is None or w.state in wanted)
        ]

    def selectable(self, role: Role) -> list[Worker]:
        """ACTIVE, healthy workers of ``role`` whose circuit lets a request through."""
        return [w for w in self._by_url.values() if w.role is role and w.selectable]

    def active_healthy_count(self, role: Role) -> int:
        return sum(
            1
            for w in self._by_url.values()
            if w.role is role and w.state is WorkerState.ACTIVE and w.healthy
        )

    # --- state changes ----------------------------------------------------------------------

    def set_state(
        self,
        worker: Worker,
        state: WorkerState,
        *,
        role: Role | None = None,
        bootstrap_port: int | None = None,
    ) -> None:
        """Move ``worker`` to ``state``; a new ``role`` bumps its epoch."""
        if state is not worker.state and state not in ALLOWED_TRANSITIONS[worker.state]:
            raise InvalidTransition(worker, state)
        if role is not None and role is not worker.role:
            self._metrics.worker_inflight.remove(worker.url, worker.role.value)
            worker.role = role
            worker.epoch += 1
            # Failures seen under the old role (e.g. 503s from its closed admission while it
            # drained) say nothing about the worker under its new one.
            worker.circuit.reset()
            worker._inflight_gauge = self._metrics.worker_inflight.labels(worker.url, role.value)
            worker._inflight_gauge.set(worker.inflight)
        if bootstrap_port is not None:
            worker.bootstrap_port = bootstrap_port
        worker.state = state
        self._export_state(worker)
        self._export_pools()
        self._notify()

    def set_health(self, worker: Worker, healthy: bool, error: str | None = None) -> None:
        if error is not None:
            worker.last_error = error
        if worker.healthy is healthy:
            return
        worker.healthy = healthy
        self._metrics.worker_healthy.labels(worker.url).set(1 if healthy else 0)
        self._notify()

    # --- in-flight accounting (hot path) ----------------------------------------------------

    def acquire(self, worker: Worker) -> None:
        """Count one request in flight on ``worker`` (both legs count until both end)."""
        worker.inflight += 1
        worker._idle.clear()
        worker.circuit.on_dispatch()
        worker._inflight_gauge.inc()

    def release(self, worker: Worker) -> None:
        worker.inflight -= 1
        worker._inflight_gauge.dec()
        if worker.inflight <= 0:
            worker.inflight = 0
            worker._idle.set()

    # --- change notification ----------------------------------------------------------------

    async def wait_for_change(self) -> None:
        """Return at the next change of membership, state or health (wrap in a timeout)."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- metrics ----------------------------------------------------------------------------

    def _on_circuit(self, url: str, state: CircuitState) -> None:
        self._metrics.circuit_state.labels(url).set(CIRCUIT_STATE_VALUES[state])

    def _export_state(self, worker: Worker) -> None:
        for state in WorkerState:
            self._metrics.worker_state.labels(worker.url, state.value).set(
                1 if worker.state is state else 0
            )

    def _export_pools(self) -> None:
        for role in Role:
            self._metrics.pool_size.labels(role.value).set(
                sum(
                    1
                    for w in self._by_url.values()
                    if w.role is role and w.state is WorkerState.ACTIVE
                )
            )
