"""A data plane's pools: the last versioned snapshot the control process pushed, and what this
process has in flight on each worker.

The control process owns every worker's state; a snapshot says, per worker, its role, its
bootstrap port, whether it may be picked (ACTIVE, healthy, admitting), whether requests may go
to it at all (``usable``: a worker that turned unhealthy, FAILED or left gets its legs ended)
and its circuit's verdict. Every data plane routes so, the one beside the control side of a
one-process router too: the request path picks from :meth:`SnapshotPools.pick`, and a
:class:`Member` has the attributes of a worker that the legs and the policies read.

A snapshot is applied only when consistent (:func:`pd_router.wire.check_consistent`: a higher
version, each worker once, well-typed and coherent entries); an inconsistent one changes
nothing, and the pools route on from the last one.

Router-wide in-flight: :attr:`Member.inflight` is this process's own count plus what the other
data planes had in flight when the control process last summed their reports (pushed every
report interval), so ``least_inflight`` and ``power_of_two`` balance the whole router's load.

Models: each worker serves one model (the snapshot names it). Serving one model (every worker
names the same, or none), the pools are that model's and a request's ``model`` is not looked
at, as SGLang's ``mini_lb`` does not; serving several, a request picks its model's
:class:`Route` by its ``model`` (:meth:`SnapshotPools.route`): an unknown name gets 404, none
at all 400, and a worker that names no model serves none of them. A model with prefill or
decode workers is served in PD; one with regular workers only, by one worker each request.

Load reports: the workers' own counts of their requests (:class:`pd_router.wire.WorkerLoads`,
sent only when a pool's policy routes by them) are set on the members as they come
(:attr:`Member.load`, :attr:`Member.load_at`), and on a member that joins later.

Circuits: the control process decides (it sums every data plane's leg outcomes); a member's
:class:`SharedCircuit` holds its verdict, turns an open one half-open when its cool-down ends,
lets one trial at a time through a half-open circuit when this process is the data plane the
control process named for the trial (one for the whole router), and queues the outcomes for
the next report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pd_router.circuit_state import CircuitState
from pd_router.dataplane.routing.policies import Policy
from pd_router.dataplane.routing.pools import Route, choose
from pd_router.errors import ModelNotFound, ModelRequired
from pd_router.roles import Role, bootstrap_host
from pd_router.wire import NO_SNAPSHOT, Snapshot, WorkerLoads, check_consistent

# The members, bound once: looking one up through its class costs about 70 ns on Python 3.11,
# and a pick asks every member's circuit.
CLOSED = CircuitState.CLOSED
OPEN = CircuitState.OPEN
HALF_OPEN = CircuitState.HALF_OPEN


class SharedCircuit:
    """The control process's verdict on one worker, and this process's outcomes for it."""

    __slots__ = (
        "_half_open_at", "_recorded", "_runs", "_state", "_trial", "_trial_here", "_wake", "url",
    )  # fmt: skip

    def __init__(self, url: str, recorded: set[SharedCircuit], wake: Callable[[], None]) -> None:
        self.url = url
        # Asks for a report now: a failure, or a trial's outcome, is what the control process
        # decides the circuit on, and the sooner it does the fewer requests meet a broken worker.
        self._wake = wake
        # Outcomes since the last report, in order, as runs: [succeeded, how many in a row]
        # (one entry per run rather than per leg: a report carries thousands of legs).
        self._runs: list[list[Any]] = []
        # The circuits with outcomes to report, shared by every member of the pools.
        self._recorded = recorded
        self._state = CLOSED
        self._half_open_at: float | None = None
        self._trial = False
        self._trial_here = True

    def update(self, state: CircuitState, half_open_at: float | None, trial_here: bool) -> None:
        """The control process's verdict; ``trial_here``: this process may send the trial of
        a half-open circuit. A trial in flight stays counted until its leg ends, whatever the
        verdict: a snapshot made before the cool-down ended may still say open after this
        process turned the circuit half-open and sent the trial."""
        self._state = state
        self._half_open_at = half_open_at
        self._trial_here = trial_here

    @property
    def state(self) -> CircuitState:
        half_open_at = self._half_open_at
        if self._state is OPEN and half_open_at is not None and time.monotonic() >= half_open_at:
            self._state = HALF_OPEN
        return self._state

    def allows(self) -> bool:
        if self._state is CLOSED:
            return True
        return self.state is HALF_OPEN and self._trial_here and not self._trial

    def on_dispatch(self) -> None:
        if self._state is HALF_OPEN:
            self._trial = True

    def record_success(self) -> None:
        self._record(True)

    def record_failure(self) -> None:
        self._record(False)

    def _record(self, ok: bool) -> None:
        self._trial = False
        if not ok or self._state is not CLOSED:
            self._wake()
        runs = self._runs
        if runs and runs[-1][0] is ok:
            runs[-1][1] += 1
        else:
            runs.append([ok, 1])
            self._recorded.add(self)

    def take_runs(self) -> list[list[Any]]:
        runs, self._runs = self._runs, []
        return runs

    def release_trial(self) -> None:
        self._trial = False


class Member:
    """One worker as a data plane routes to it (what the legs and the policies read)."""

    __slots__ = (
        "bootstrap_host",
        "bootstrap_port",
        "circuit",
        "epoch",
        "idle_at",
        "inflight",
        "load",
        "load_at",
        "local",
        "model",
        "pickable",
        "reported",
        "role",
        "url",
        "usable",
    )

    def __init__(self, url: str, role: Role, circuit: SharedCircuit) -> None:
        self.url = url
        self.role = role
        self.model = ""
        # The registry's epoch of the worker: a role change through a conversion or one the
        # router adopted moves it on (a quarantined pair is released by it).
        self.epoch = 0
        self.bootstrap_port: int | None = None
        self.bootstrap_host = bootstrap_host(url)
        self.circuit = circuit
        self.pickable = False
        self.usable = False
        # This process's requests in flight on the worker, the count last reported, the
        # router-wide count (the others' share as last summed, plus ``local``) and when
        # ``local`` last fell to zero (monotonic).
        self.local = 0
        self.reported = 0
        self.inflight = 0
        self.idle_at = 0.0
        # The worker's requests by its last load report (None: none) and when it was read.
        self.load: int | None = None
        self.load_at = 0.0


def routes_of(
    snapshot: Snapshot, members: Iterable[Member]
) -> tuple[dict[str, Route[Member]], Route[Member] | None]:
    """The routes of ``snapshot`` by model name, and the one route every request takes when
    the workers serve one model (or name none); ``members`` are the pickable ones."""
    models: dict[str, list[Member]] = {}
    pd: set[str] = set()
    for entry in snapshot.workers:
        models.setdefault(entry.model, [])
        if entry.role is not Role.REGULAR:
            pd.add(entry.model)
    named = [model for model in models if model]
    if len(named) <= 1:
        route = Route(named[0] if named else "", members, regular=bool(models) and not pd)
        return ({route.model: route} if named else {}), route
    for member in members:
        if member.model:
            models[member.model].append(member)
    routes = {model: Route(model, models[model], model not in pd) for model in named}
    return routes, None


UnavailableCallback = Callable[[str], None]


class SnapshotPools:
    """The pools of one data plane: pick, count in flight, apply what the control process
    pushes. ``wake`` asks for a report now (a worker out of selection became idle here: a
    conversion waits for it; a leg failed, or a trial ended: its circuit is decided on it);
    ``suspect`` tells the control process a worker answered for the other role,
    ``stuck(prefill, decode)`` that a pair missed its rendezvous; ``on_unavailable(url)`` ends
    the legs still running on a worker that left service. ``index`` is this data plane's
    number, by which a snapshot names the one that may send a half-open circuit's trial (none
    at all while a trial moves)."""

    def __init__(
        self,
        policies: dict[Role, Policy],
        *,
        index: int,
        wake: Callable[[], None],
        suspect: Callable[[str], None],
        stuck: Callable[[str, str], None],
        on_unavailable: UnavailableCallback,
        count_refusal: Callable[[str, str], None],
    ) -> None:
        self.policies = policies
        self.index = index
        # The version of the snapshot routed from.
        self.version = NO_SNAPSHOT
        self._recorded: set[SharedCircuit] = set()
        self._wake = wake
        self._suspect = suspect
        self._stuck = stuck
        self._on_unavailable = on_unavailable
        self._count_refusal = count_refusal
        self._members: dict[str, Member] = {}
        # Members no longer in the snapshot, kept while requests are in flight on them.
        self._gone: set[str] = set()
        # The routes by model, and the one every request takes while the workers serve one
        # model (None while they serve several).
        self._routes: dict[str, Route[Member]] = {}
        self._only: Route[Member] | None = NO_ROUTE
        # The last load reports pushed, for members that join after them.
        self._loads: Mapping[str, tuple[int, float]] = {}

    # --- what the control process pushes ---------------------------------------------------

    def apply(self, snapshot: Snapshot) -> None:
        """Take ``snapshot`` as the pools; InconsistentSnapshot (nothing changed) when it breaks
        an invariant (:func:`pd_router.wire.check_consistent`)."""
        check_consistent(snapshot, self.version)
        seen = set()
        for entry in snapshot.workers:
            url = entry.url
            seen.add(url)
            role = entry.role
            member = self._members.get(url)
            self._gone.discard(url)
            if member is None:
                member = Member(url, role, SharedCircuit(url, self._recorded, self._wake))
                self._members[url] = member
                if self._loads:
                    set_load(member, self._loads.get(url))
            elif member.role is not role:
                self.policies[member.role].forget(url)
                member.role = role
            member.model = entry.model
            member.epoch = entry.epoch
            member.bootstrap_port = entry.bootstrap_port
            member.pickable = entry.pickable
            member.circuit.update(entry.circuit, entry.half_open_at, entry.trial == self.index)
            self._set_usable(member, entry.usable)
        for url in [url for url in self._members if url not in seen]:
            member = self._members[url]
            self._set_usable(member, False)
            member.pickable = False
            self.policies[member.role].forget(url)
            if member.local == 0:
                del self._members[url]
            else:
                self._gone.add(url)
        self._routes, self._only = routes_of(
            snapshot, [m for m in self._members.values() if m.pickable]
        )
        self.version = snapshot.version

    def apply_inflight(self, totals: Mapping[str, int]) -> None:
        """The router-wide in-flight counts the control process summed from every report."""
        for url, total in totals.items():
            member = self._members.get(url)
            if member is not None:
                member.inflight = max(member.local, total - member.reported + member.local)

    def apply_loads(self, message: WorkerLoads) -> None:
        """The workers' load reports; a member absent from them has none."""
        self._loads = loads = message.loads
        for url, member in self._members.items():
            set_load(member, loads.get(url))

    def _set_usable(self, member: Member, usable: bool) -> None:
        if member.usable and not usable:
            self._on_unavailable(member.url)
        member.usable = usable

    # --- the request path ------------------------------------------------------------------

    def route(self, model: object) -> Route[Member]:
        """The route of a request naming ``model`` (its body's field; None when absent): the
        only one while the workers serve one model, else the model's; ModelNotFound (404) for
        a name no worker serves, ModelRequired (400) for none."""
        only = self._only
        if only is not None:
            return only
        if model is None:
            raise ModelRequired(list(self._routes))
        route = self._routes.get(model) if isinstance(model, str) else None
        if route is None:
            raise ModelNotFound(str(model))
        return route

    def models(self) -> list[str]:
        """The models the workers serve, named."""
        return list(self._routes)

    def pick(
        self,
        role: Role,
        avoid: Iterable[Member] = (),
        prompt: Callable[[], str] | None = None,
        route: Route[Member] | None = None,
    ) -> Member:
        """A selectable member of ``role`` in ``route`` (None: the only one), its circuit
        allowing; the ones in ``avoid`` only when nothing else is left; when every circuit
        keeps the pool out, the pickable members not in ``avoid`` anyway (panic mode,
        :mod:`pd_router.control.circuit`)."""
        if route is None:
            route = self._only or NO_ROUTE
        pool = route.pools[role]
        return choose(
            role,
            [m for m in pool if m.circuit.allows()] or without(pool, avoid),
            avoid,
            self.policies[role],
            prompt,
            self._count_refusal,
            route.model,
        )

    def member(self, url: str) -> Member | None:
        """The member ``url`` of the last snapshot (or one left with requests in flight)."""
        return self._members.get(url)

    def acquire(self, member: Member) -> None:
        member.local += 1
        member.inflight += 1
        member.circuit.on_dispatch()

    def release(self, member: Member) -> None:
        member.local -= 1
        member.inflight = max(0, member.inflight - 1)
        if member.local == 0:
            member.idle_at = time.monotonic()
            if not member.pickable:
                self._wake()

    def suspect(self, member: Member) -> None:
        self._suspect(member.url)

    def stuck(self, prefill: Member, decode: Member) -> None:
        self._stuck(prefill.url, decode.url)

    # --- what the reports carry ------------------------------------------------------------

    def inflight_report(self) -> tuple[dict[str, int], dict[str, float]]:
        """This process's in-flight count per worker, and when each idle one became idle;
        members that left the snapshot are dropped once they reported idle."""
        counts = {}
        idle = {}
        for url, member in list(self._members.items()):
            counts[url] = member.local
            member.reported = member.local
            if member.local == 0:
                idle[url] = member.idle_at
                if url in self._gone:
                    self._gone.discard(url)
                    del self._members[url]
        return counts, idle

    def take_outcomes(self) -> tuple[tuple[str, bool, int], ...]:
        """The leg outcomes since the last call: ``(url, succeeded, how many in a row)``, in
        order per worker."""
        outcomes = tuple(
            (circuit.url, ok, count)
            for circuit in self._recorded
            for ok, count in circuit.take_runs()
        )
        self._recorded.clear()
        return outcomes


# What a request picks from while the workers serve several models and it names none.
NO_ROUTE: Route[Member] = Route("", (), regular=False)


def set_load(member: Member, report: tuple[int, float] | None) -> None:
    """Set ``member``'s load report (requests, when read), or none."""
    if report is None:
        member.load = None
    else:
        member.load, member.load_at = report


def without(members: list[Member], avoid: Iterable[Member]) -> list[Member]:
    avoided = set(avoid)
    return [m for m in members if m not in avoided]
