"""The control side of the data planes: the snapshots it pushes, the reports it reads. A
one-process router has one data plane, linked in memory (a
:class:`~pd_router.dataplane.link.channel.LocalChannel`); ``--workers N`` has N data-plane
processes, linked over sockets. Both are read and fed alike.

Every change to the registry that a data plane routes by (membership, role, state, health,
admission, bootstrap port, circuit) makes a new snapshot version, pushed to every data plane at
once; each data plane answers with a report naming the version it now routes from (its ack).
The messages are :mod:`pd_router.wire`'s; a data plane speaking another protocol version is
refused at its hello (logged, its channel closed). A data plane that finds a snapshot
inconsistent keeps routing from the one before and says so; it is logged here, and its ack stays
behind until a consistent snapshot comes.

In-flight. The registry's in-flight count of a worker is the sum of the data planes' last
reports, plus one for every data plane that has not yet acked the version in which the worker
stopped being pickable: until it has, it may still pick the worker. So a conversion's drain
(and a removal), which waits for that count to reach zero, ends only once every data plane
stopped picking the worker and has nothing in flight on it, as the replicas' drain reports do
across routers. A data plane that exits takes its in-flight requests with it: its share is
dropped at once, so nothing waits for a report that will not come.

The rest of a report goes to the control side's owners of it: leg outcomes to the worker's
circuit, TTFT/TPOT samples and refusals to the latency recorder the autopilot
reads; a leg answered for the other role makes the health monitor read the worker's role now,
and a pair that missed its rendezvous makes its decode forget the prefill's endpoints (``forget``,
for SGLang 0.5.23's decode that kept them across the prefill's round trip, which this router
did not see: another router's or an operator's switch, or one faster than a health probe).

Half-open trials. Every snapshot names, for each worker whose circuit is not closed, the one
data plane that may send its trial (:mod:`pd_router.control.trials`); a trial that should move
is looked at every :data:`INFLIGHT_PUSH_SECS`.

Load reports. What the workers report about their own load (the registry keeps it, for the
pools whose policy routes by it) goes to every data plane in a
:class:`~pd_router.wire.WorkerLoads` when one changed, at most every :data:`INFLIGHT_PUSH_SECS`
(a round of reads changes many at once), and to a data plane as it attaches; a router that
reads none sends none.

Client connections. Each report counts the data plane's open client connections; while they are
uneven (:func:`connection_share`), the in-flight push carries the share each should keep, and
a data plane above it closes its surplus between answers
(:mod:`pd_router.dataplane.front.listener`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from pd_router.control.circuit import CircuitState
from pd_router.control.health import HealthMonitor
from pd_router.control.latency import Latencies
from pd_router.control.trials import HalfOpenTrials
from pd_router.control.workers import UnknownWorker, Worker, WorkerRegistry, WorkerState
from pd_router.roles import Role
from pd_router.wire import (
    HEARTBEAT_SECS,
    PROTOCOL_VERSION,
    ChannelClosed,
    ChannelEnd,
    Hello,
    InflightTotals,
    Message,
    MetricsAnswer,
    MetricsAsk,
    Report,
    Sample,
    Snapshot,
    SnapshotRefused,
    StuckPair,
    Suspect,
    VersionMismatch,
    WireError,
    WorkerEntry,
    WorkerLoads,
    check_hello,
)

log = logging.getLogger("pd_router.dataplanes")

INFLIGHT_PUSH_SECS = 0.025
METRICS_TIMEOUT_SECS = 2.0
# A data plane sends something at least every HEARTBEAT_SECS; one silent for longer than this
# is hung (stopped, or its event loop blocked), as is one that has not reported within the
# start allowance of being started.
SILENCE_SECS = 5.0
START_SILENCE_SECS = 30.0


def connection_share(counts: list[int]) -> int | None:
    """The most client connections a data plane should keep, given every data plane's count:
    the mean rounded up while the counts differ by more than one, else None (as even as they
    can be: moving a connection would only move the difference)."""
    if len(counts) < 2 or max(counts) - min(counts) <= 1:
        return None
    return -(-sum(counts) // len(counts))


class DataPlaneLink:
    """One data plane as the control process knows it."""

    def __init__(self, index: int, channel: ChannelEnd, version: int) -> None:
        self.index = index
        self.channel = channel
        # The snapshot version it routes from: the one it acked, or the first one it was sent
        # (it cannot pick before it has one).
        self.acked = version
        self.inflight: Mapping[str, int] = {}
        self.idle_at: Mapping[str, float] = {}
        self.connections = 0
        # Its metric samples as last sent, asked or not (kept when it exits: counters never
        # go back).
        self.samples: tuple[Sample, ...] = ()
        self.reader: asyncio.Task | None = None
        # When it counts as hung unless heard from before (time.monotonic).
        self.silent_by = time.monotonic() + START_SILENCE_SECS


# ``forget(decode, prefill)``: the decode drops what it cached of the prefill's endpoints.
Forget = Callable[[Worker, Worker], Coroutine[Any, Any, None]]


class DataPlanes:
    """The links to the data planes, and what their reports change in the registry."""

    def __init__(
        self,
        registry: WorkerRegistry,
        health: HealthMonitor,
        latency: Latencies,
        forget: Forget,
    ) -> None:
        self._registry = registry
        self._health = health
        self._latency = latency
        self._forget = forget
        self._forgetting: set[asyncio.Task[None]] = set()
        self._links: dict[int, DataPlaneLink] = {}
        self.version = 0
        self._snapshot = Snapshot(0, ())
        # The version in which each worker stopped being pickable (absent while it is).
        self._stopped_at: dict[str, int] = {}
        self._pickable: set[str] = set()
        self._totals: dict[str, int] = {}
        self._pushed: InflightTotals | None = None
        # The counters and histograms of data planes that exited, as they last sent them.
        self._retired: list[Sample] = []
        self._metrics_requests = 0
        self._metrics_waiters: dict[int, MetricsRequest] = {}
        self._pusher: asyncio.Task | None = None
        self._pushing = False
        self._again = False
        self._trials = HalfOpenTrials()
        # Whether a load report changed since the data planes were last sent them.
        self._loads_changed = False
        registry.on_change(self.push)
        registry.on_load_report(self._load_report_changed)

    # --- links ------------------------------------------------------------------------------

    def attach(self, index: int, channel: ChannelEnd) -> None:
        """Start talking to data plane ``index``: send it the hello and the current snapshot,
        read its hello, then its reports until its channel closes."""
        self.detach(index)
        link = DataPlaneLink(index, channel, self.version)
        self._links[index] = link
        channel.send(Hello(PROTOCOL_VERSION))
        channel.send(self._snapshot)
        loads = self._loads()
        if loads.loads:
            channel.send(loads)
        link.reader = asyncio.get_running_loop().create_task(self._read(link))
        if self._pusher is None:
            self._pusher = asyncio.get_running_loop().create_task(self._push_totals())

    def detach(self, index: int) -> None:
        """Forget data plane ``index`` (it exited): its in-flight requests are gone with it."""
        link = self._links.pop(index, None)
        if link is None:
            return
        link.channel.close()
        self._retired.extend(s for s in link.samples if s[1] in ("counter", "histogram"))
        if link.reader is not None and link.reader is not asyncio.current_task():
            link.reader.cancel()
        for waiting in self._metrics_waiters.values():
            waiting.answered(index)
        self._recount()

    def unresponsive(self, index: int) -> bool:
        """Whether data plane ``index`` has been silent for longer than a live one can be."""
        link = self._links.get(index)
        return link is not None and time.monotonic() > link.silent_by

    async def stop(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
        for task in list(self._forgetting):
            task.cancel()
        for index in list(self._links):
            self.detach(index)

    # --- snapshots --------------------------------------------------------------------------

    def push(self) -> None:
        """Make a new snapshot version of the registry and send it to every data plane. A
        change made while the snapshot is read (a circuit turning half-open as its state is
        read) makes another one right after."""
        if self._pushing:
            self._again = True
            return
        self._pushing = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._push()
        finally:
            self._pushing = False

    def _push(self) -> None:
        self.version += 1
        workers = []
        pickable = set()
        for worker in self._registry:
            state = worker.circuit.state
            closed = state is CircuitState.CLOSED
            trial = self._trials.holder(worker.url, closed, self._links, self.version)
            entry = entry_of(worker, state, trial)
            workers.append(entry)
            if entry.pickable:
                pickable.add(worker.url)
        for url in self._pickable - pickable:
            self._stopped_at.setdefault(url, self.version)
        for url in pickable:
            self._stopped_at.pop(url, None)
        known = self._known()
        for url in [url for url in self._stopped_at if url not in known]:
            del self._stopped_at[url]
        self._trials.forget(known)
        self._pickable = pickable
        self._snapshot = Snapshot(self.version, tuple(workers))
        for link in self._links.values():
            link.channel.send(self._snapshot)
        self._recount()

    def _known(self) -> set[str]:
        return {worker.url for worker in self._registry}

    # --- load reports ---------------------------------------------------------------------

    def _load_report_changed(self) -> None:
        self._loads_changed = True

    def _loads(self) -> WorkerLoads:
        """Every worker's last load report, as the data planes route by it."""
        return WorkerLoads(
            {
                worker.url: (report.requests, report.read_at)
                for worker in self._registry
                if (report := worker.load_report) is not None
            }
        )

    # --- reports ----------------------------------------------------------------------------

    async def _read(self, link: DataPlaneLink) -> None:
        """Read the data plane's hello, then what it sends, until its channel closes; a data
        plane of another protocol version, or one that sends what it should not, is refused."""
        try:
            check_hello(await link.channel.receive())
            while True:
                message = await link.channel.receive()
                link.silent_by = time.monotonic() + SILENCE_SECS
                self._take(link, message)
        except ChannelClosed:
            pass
        except VersionMismatch as exc:
            log.error(
                "data plane %d speaks protocol version %d, this control process %d: refused",
                link.index, exc.theirs, PROTOCOL_VERSION,
            )  # fmt: skip
        except WireError as exc:
            log.error("data plane %d refused: %s", link.index, exc)
        except Exception:
            log.exception("bad message from data plane %d", link.index)
        if self._links.get(link.index) is link:
            self.detach(link.index)

    def _take(self, link: DataPlaneLink, message: Message) -> None:
        match message:
            case Report():
                self._take_report(link, message)
            case Suspect():
                self._suspect(message.url)
            case StuckPair():
                self._stuck(message.prefill, message.decode)
            case MetricsAnswer():
                self._take_metrics(link, message)
            case SnapshotRefused():
                log.error(
                    "data plane %d refused snapshot %d (%s); it routes from snapshot %d",
                    link.index, message.version, message.reason, message.routing,
                )  # fmt: skip
            case _:
                raise WireError(f"{type(message).__name__} is not for the control side")

    def _take_report(self, link: DataPlaneLink, report: Report) -> None:
        link.acked = max(link.acked, report.version)
        link.inflight = report.inflight
        link.idle_at = report.idle_at
        link.connections = report.connections
        for url, ok, count in report.outcomes:
            worker = self._find(url)
            if worker is None:
                continue
            if ok:
                worker.circuit.record_success(count)
            else:
                for _ in range(count):
                    worker.circuit.record_failure()
        for seconds, prefilled_after, model in report.ttft:
            self._latency.observe_ttft(seconds, prefilled_after, model)
        for seconds, events, model in report.tpot:
            self._latency.observe_stream(seconds, events, model)
        for model, role, count in report.refused:
            for _ in range(count):
                self._latency.count_refusal(role, model)
        self._recount()

    def _suspect(self, url: str) -> None:
        worker = self._find(url)
        if worker is not None:
            self._health.suspect(worker)

    def _stuck(self, prefill_url: str, decode_url: str) -> None:
        prefill, decode = self._find(prefill_url), self._find(decode_url)
        if prefill is None or decode is None or decode.role is not Role.DECODE:
            return
        task = asyncio.get_running_loop().create_task(self._forget(decode, prefill))
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)

    def _find(self, url: str) -> Worker | None:
        try:
            return self._registry.get(url)
        except UnknownWorker:
            return None

    def _recount(self) -> None:
        """Set each worker's in-flight count from the reports and the missing acks."""
        links = list(self._links.values())
        totals = {}
        for worker in self._registry:
            url = worker.url
            stopped = self._stopped_at.get(url)
            count = sum(link.inflight.get(url, 0) for link in links)
            stale = 0 if stopped is None else sum(1 for link in links if link.acked < stopped)
            count += stale
            self._registry.set_picked_elsewhere(worker, stale > 0)
            totals[url] = count
            if count != worker.inflight or count == 0:
                idle_at = max((link.idle_at.get(url, 0.0) for link in links), default=0.0)
                self._registry.set_inflight(worker, count, idle_at or time.monotonic())
        self._totals = totals

    async def _push_totals(self) -> None:
        """Send the router-wide in-flight counts and the connection share to the data planes
        when they changed, and at least every :data:`HEARTBEAT_SECS`; the load reports when
        one changed; move a half-open trial whose data plane cannot send it (a new
        snapshot)."""
        sent_at = time.monotonic()
        while True:
            await asyncio.sleep(INFLIGHT_PUSH_SECS)
            if self._trials.unsettled(self._links):
                self.push()
            if self._loads_changed:
                self._loads_changed = False
                loads = self._loads()
                for link in self._links.values():
                    link.channel.send(loads)
            now = time.monotonic()
            share = connection_share([link.connections for link in self._links.values()])
            message = InflightTotals(self._totals, share)
            if message != self._pushed or now - sent_at >= HEARTBEAT_SECS:
                sent_at = now
                self._pushed = message
                for link in self._links.values():
                    link.channel.send(message)

    # --- metrics ----------------------------------------------------------------------------

    async def collect_metrics(self) -> list[Sample]:
        """Every data plane's metric samples: the live ones' asked for now (a scrape), and the
        counters of those that exited as they were last collected."""
        self._metrics_requests += 1
        number = self._metrics_requests
        waiting = self._metrics_waiters[number] = MetricsRequest(set(self._links))
        for link in self._links.values():
            link.channel.send(MetricsAsk(number))
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiting.done.wait(), METRICS_TIMEOUT_SECS)
        finally:
            del self._metrics_waiters[number]
        live = [sample for link in self._links.values() for sample in link.samples]
        return live + self._retired

    def _take_metrics(self, link: DataPlaneLink, message: MetricsAnswer) -> None:
        link.samples = message.samples
        waiting = self._metrics_waiters.get(message.request)
        if waiting is not None:
            waiting.answered(link.index)


class MetricsRequest:
    """The data planes a scrape still waits for; one that exits is not waited for."""

    def __init__(self, indexes: set[int]) -> None:
        self._waiting = indexes
        self.done = asyncio.Event()
        if not indexes:
            self.done.set()

    def answered(self, index: int) -> None:
        self._waiting.discard(index)
        if not self._waiting:
            self.done.set()


def entry_of(worker: Worker, circuit: CircuitState, trial: int | None) -> WorkerEntry:
    """A worker as a snapshot carries it, its circuit in state ``circuit`` (read once: reading
    it may turn it half-open) and its trial held by data plane ``trial``."""
    return WorkerEntry(
        url=worker.url,
        role=worker.role,
        model=worker.model_name,
        epoch=worker.epoch,
        bootstrap_port=worker.bootstrap_port,
        pickable=worker.state is WorkerState.ACTIVE and worker.healthy and worker.admitting,
        usable=worker.healthy and worker.state is not WorkerState.FAILED,
        circuit=circuit,
        half_open_at=worker.circuit.half_open_at,
        trial=trial,
    )
