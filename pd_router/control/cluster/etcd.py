"""A router replica that agrees with its peers through etcd.

The replica holds one lease, kept alive while it runs; everything that must vanish with it (its
entry under ``replicas/``, the locks and slots of the conversions it runs, its drain reports,
the autopilot's leadership) is put under that lease. One watch over the cluster's keys keeps
a :class:`ClusterView`, and the :class:`Mirror` applies the worker records to the registry.

A conversion is claimed in one transaction: the worker's lock, a free slot of the cluster-wide
cap and the record (DRAINING, held by the conversion) change together, and only if no worker
record changed since this replica last saw them (so the pool minimums checked on its view hold
across replicas). Its outcome is published in one transaction too, which also drops the lock,
the slot and the drain reports. When a replica dies, its lease expires and its locks go: a
conversion whose worker record is still held but has no lock is an orphan, and the first
replica to lock it reads the worker's live role and publishes that (finished or rolled back).

While etcd cannot be reached the replica routes on what it last saw, refuses what needs the
others' agreement (conversions, adding and removing workers: 503), and exports
``pd_router_cluster_etcd_up 0``; once etcd answers it reads everything again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import orjson

from pd_protocol.backoff import Backoff
from pd_protocol.cluster import ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import (
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    EventType,
    LeaseNotFound,
    Operation,
    WatchCompacted,
    delete_op,
    delete_prefix_op,
    if_absent,
    if_nothing_changed_under,
    if_unchanged,
    put_op,
)
from pd_router.control.cluster.config import default_replica_id
from pd_router.control.cluster.local import ConversionTaken
from pd_router.control.cluster.mirror import Mirror
from pd_router.control.cluster.view import ClusterView, StoredRecord
from pd_router.control.errors import ClusterUnavailable, ConversionRefused
from pd_router.control.workers import (
    DuplicateWorker,
    Role,
    UnknownWorker,
    Worker,
    WorkerRegistry,
    WorkerState,
    normalize_url,
)

if TYPE_CHECKING:
    import aiohttp

    from pd_router.config import RouterConfig
    from pd_router.metrics import RouterMetrics

log = logging.getLogger("pd_router.cluster")

T = TypeVar("T")
# How an orphaned conversion is settled: the worker's role now, and its bootstrap port.
SettleOrphan = Callable[[Worker, Role], Awaitable[tuple[Role, int | None]]]
P = ParamSpec("P")

RETRY_INITIAL_SECS = 0.1
RETRY_MAX_SECS = 2.0
# A lock that went with its replica's lease is settled after this pause, so that a conversion
# ending normally (its record and its lock change in one transaction) is never mistaken for one.
ORPHAN_GRACE_SECS = 0.2
# How often a claim catches up with records that changed under it before it gives up.
CLAIM_CATCH_UPS = 3
# How long a worker that serves stays in the pools after its record went without a removal, in
# lease TTLs: one for the worker to find its lease expired, one to register again.
UNREGISTERED_GRACE_TTLS = 2


class EtcdCluster:
    enabled = True

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        *,
        probe: Callable[[Worker], Coroutine[Any, Any, Any]],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
        session: aiohttp.ClientSession,
    ) -> None:
        """``session`` is the router's shared client session, which etcd is called on; the
        conversion runner that settles orphaned conversions is given by
        :meth:`settle_orphans_with` (it is built after this cluster, which it claims through)."""
        cluster = config.cluster
        self.replica_id = cluster.replica_id or default_replica_id()
        self.name = cluster.name
        self._config = config
        self._registry = registry
        self._spawn = spawn
        self._session = session
        self._settle_orphan: SettleOrphan | None = None
        self._keys = ClusterKeys(cluster.name, cluster.prefix)
        self._endpoints = cluster.etcd
        self._ttl = cluster.lease_ttl_secs
        self._metrics = metrics
        self.view = ClusterView(self._keys)
        self.mirror = Mirror(
            registry,
            self.view,
            self.replica_id,
            probe=probe,
            report_drained=self._report_drained,
            spawn=spawn,
            removal_timeout_secs=config.worker_removal_timeout_secs,
            grace_secs=UNREGISTERED_GRACE_TTLS * self._ttl,
        )
        self._clients: list[EtcdClient] = []
        self._current = 0
        self._lease: int | None = None
        self._up = False
        self._seeded = False
        self._synced = asyncio.Event()
        self._task: asyncio.Task | None = None
        # What this replica last wrote for each conversion it runs, and the slot it holds.
        self._own: dict[str, tuple[str, StoredRecord]] = {}
        # The revision at which each conversion's outcome was published (None: a retry will
        # publish it), until the conversion lets its worker go.
        self._released: dict[str, int | None] = {}
        self._slots: dict[str, str] = {}
        self._settling: set[str] = set()
        registry.on_adopted(self._publish_adopted)
        metrics.cluster_unregistered_workers.set_function(lambda: self.mirror.unregistered_count)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Join in the background; wait up to one lease TTL for the first full read, so a
        replica usually starts with the cluster's workers, but starts without etcd too."""
        timeout = min(2.0, self._ttl / 2)
        self._clients = [EtcdClient(self._session, e, timeout=timeout) for e in self._endpoints]
        self._metrics.cluster_etcd_up.set(0)
        self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            await asyncio.wait_for(asyncio.shield(self._synced.wait()), self._ttl)
        except TimeoutError:
            log.warning(
                "etcd %s not reachable: routing on the configured workers until it is",
                ", ".join(self._endpoints),
            )

    async def stop(self) -> None:
        """Stop following and revoke the lease: this replica's locks, reports and leadership
        go at once instead of a TTL later."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.mirror.stop()
        lease, self._lease = self._lease, None
        if lease is not None and self._up:
            try:
                await self._etcd("revoke", lambda c: c.revoke_lease(lease))
            except EtcdError as exc:
                log.info("could not revoke the lease on leaving: %s", exc)
        self._set_up(False)

    def settle_orphans_with(self, settle: SettleOrphan) -> None:
        """Settle the conversions whose replica went with ``settle`` (the conversion runner's
        ``settle_orphan``, which reads the worker's live role)."""
        self._settle_orphan = settle

    def is_leader(self) -> bool:
        return self._up and self.view.leader == self.replica_id

    def conversion_id(self, number: int) -> str:
        return f"{self.replica_id}-c{number}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "name": self.name,
            "replica_id": self.replica_id,
            "etcd_up": self._up,
            "leader": self.view.leader,
            "replicas": sorted(self.view.replicas),
            "conversions": dict(sorted(self.view.locks.items())),
            **self.mirror.as_dict(),
        }

    # --- following etcd ---------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(RETRY_INITIAL_SECS, RETRY_MAX_SECS)
        while True:
            try:
                await self._join()
                backoff.reset()
                await self._follow()
            except WatchCompacted as exc:
                log.warning("cluster watch fell behind (%s); reading everything again", exc)
            except EtcdError as exc:
                if self._up:
                    log.warning("etcd unreachable (%s); routing on the last state seen", exc)
                self._set_up(False)
                await backoff.sleep()

    async def _join(self) -> None:
        """Lease, presence, the configured workers (once, and again when etcd lost its data),
        a full read, an election."""
        if self._lease is None:
            lease = await self._etcd("grant", lambda c: c.grant_lease(self._ttl))
            self._lease = lease.id
        presence = orjson.dumps({"id": self.replica_id, "started_at": time.time()})
        try:
            await self._etcd(
                "join",
                lambda c: c.put(
                    self._keys.replica(self.replica_id), presence, lease=self._lease or 0
                ),
            )
        except LeaseNotFound:
            self._lease = None
            raise
        if not self._seeded:
            await self._seed()
            self._seeded = True
        kvs, revision = await self._etcd("read", lambda c: c.get_prefix(self._keys.root))
        if revision < self.view.revision:
            log.warning(
                "etcd is at revision %d, before the %d this replica saw: its data was restored "
                "or lost; putting the workers of this replica's configuration back",
                revision, self.view.revision,
            )  # fmt: skip
            await self._seed()
            kvs, revision = await self._etcd("read", lambda c: c.get_prefix(self._keys.root))
        self.view.reset(kvs, revision)
        self.mirror.sync_all()
        if not self._up:
            log.info("joined cluster %s as replica %s", self.name, self.replica_id)
        self._set_up(True)
        self._synced.set()
        await self._elect()
        self._settle_orphans()
        self._export()

    async def _seed(self) -> None:
        """Put the workers of this replica's configuration that no record names yet."""
        config = self._config
        specs = [(s, Role.PREFILL) for s in config.prefill] + [
            (s, Role.DECODE) for s in config.decode
        ]
        for spec, role in specs:
            record = WorkerRecord(spec.url, role.value, spec.bootstrap_port, source="config")
            key = self._keys.worker(spec.url)
            await self._etcd("seed", EtcdClient.put_if_absent, key, record.encode())

    async def _follow(self) -> None:
        """Apply every change until the watch or the lease fails."""
        client = self._clients[self._current]
        watch = client.watch_prefix(
            self._keys.root, start_revision=self.view.revision + 1, reconnect_within=2 * self._ttl
        )
        keepalive = asyncio.get_running_loop().create_task(self._keepalive())
        follow = asyncio.get_running_loop().create_task(self._apply_events(watch))
        try:
            done, _ = await asyncio.wait({keepalive, follow}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            keepalive.cancel()
            follow.cancel()
            await asyncio.gather(keepalive, follow, return_exceptions=True)

    async def _apply_events(self, watch: Any) -> None:
        async for event in watch:
            url = self.view.apply(event)
            if url is not None:
                self.mirror.changed(url)
            elif event.type is EventType.DELETE:
                self._after_delete(event.kv.key)
            self._export()

    def _after_delete(self, key: str) -> None:
        if key == self._keys.leader:
            self._spawn(self._elect_quietly())
        elif key.startswith((self._keys.locks, self._keys.replicas)):
            self._spawn(self._settle_orphans_soon())

    async def _keepalive(self) -> None:
        """Refresh the lease every third of its TTL, and sooner while etcd does not answer, so
        a stall shorter than the TTL costs nothing and the end of a longer one is seen at once;
        etcd being away marks the replica down (and up again when it answers); a lost lease
        ends the follow, to join afresh (the workers whose records went meanwhile keep serving
        through the mirror's grace period, so nothing in flight here is dropped)."""
        delay = self._ttl / 3
        retry = Backoff(RETRY_INITIAL_SECS, self._ttl / 3)
        while True:
            await asyncio.sleep(delay)
            lease = self._lease
            if lease is None:
                return
            try:
                await self._etcd("keepalive", EtcdClient.keepalive, lease)
            except LeaseNotFound:
                log.warning("lease of replica %s expired; joining again", self.replica_id)
                self._lease = None
                return
            except EtcdUnavailable as exc:
                if self._up:
                    log.warning("etcd unreachable (%s); routing on the last state seen", exc)
                self._set_up(False)
                delay = retry.take()
                continue
            delay = self._ttl / 3
            retry.reset()
            if not self._up:
                log.info("etcd reachable again")
                self._set_up(True)

    # --- leadership -------------------------------------------------------------------------

    async def _elect(self) -> None:
        if self.view.leader is None and self._lease is not None:
            won = await self._etcd(
                "elect",
                lambda c: c.put_if_absent(
                    self._keys.leader, self.replica_id.encode(), lease=self._lease or 0
                ),
            )
            if won:
                log.info("replica %s leads the cluster (runs the autopilot)", self.replica_id)

    async def _elect_quietly(self) -> None:
        try:
            await self._elect()
        except EtcdError as exc:
            log.info("election deferred: %s", exc)

    # --- conversions ------------------------------------------------------------------------

    async def claim(
        self, worker: Worker, conversion_id: str, to_role: Role, recheck: Callable[[], None]
    ) -> None:
        with self._agreement("conversions"):
            self.mirror.own_conversions.add(conversion_id)
            try:
                await self._claim(worker, conversion_id, to_role, recheck)
            except BaseException:
                self.mirror.own_conversions.discard(conversion_id)
                raise

    async def _claim(
        self, worker: Worker, conversion_id: str, to_role: Role, recheck: Callable[[], None]
    ) -> None:
        """Try the slots in turn. The claim holds only if no worker record changed since the
        state the caller checked its pool minimums on; when one did, catch up with etcd, have
        the caller check again, and retry."""
        seen = self.view.revision
        value = orjson.dumps({"conversion": conversion_id, "replica": self.replica_id})
        index = catch_ups = 0
        while index < self._config.conversion.max_concurrent:
            url, stored = worker.url, self._claimable(worker)
            lock, slot, key = self._keys.lock(url), self._keys.slot(index), stored.key
            claimed = stored.record.evolve(
                state=WorkerState.DRAINING.value,
                conversion=conversion_id,
                owner=self.replica_id,
                to_role=to_role.value,
            )
            compares = [
                if_absent(lock),
                if_absent(slot),
                if_unchanged(key, stored.mod_revision),
                if_nothing_changed_under(self._keys.workers, seen),
            ]
            lease = self._lease or 0
            ops = [
                put_op(lock, value, lease=lease),
                put_op(slot, value, lease=lease),
                put_op(key, claimed.encode(), lease=stored.lease),
            ]
            result = await self._etcd("claim", EtcdClient.txn, compares, ops)
            if result.succeeded:
                self._own[conversion_id] = (
                    url,
                    StoredRecord(claimed, key, result.revision, stored.lease),
                )
                self._slots[conversion_id] = slot
                return
            if await self._etcd("claim", EtcdClient.get, lock) is not None:
                raise ConversionRefused(
                    "already_converting", f"another replica converts worker {worker.url}"
                )
            if await self._etcd("claim", EtcdClient.get, slot) is not None:
                index += 1
                continue
            catch_ups += 1
            if catch_ups > CLAIM_CATCH_UPS:
                raise ConversionRefused(
                    "cluster_changed",
                    "the cluster's workers kept changing while the conversion was checked; "
                    "try again",
                )
            await self._catch_up(result.revision)
            recheck()
            seen = self.view.revision
        raise ConversionRefused(
            "too_many_conversions",
            f"the cluster runs its limit of {self._config.conversion.max_concurrent} conversion(s)",
        )

    def _claimable(self, worker: Worker) -> StoredRecord:
        stored = self._stored(worker)
        record = stored.record
        if record.conversion is not None or record.state != WorkerState.ACTIVE:
            raise ConversionRefused(
                "already_converting", f"worker {worker.url} is {record.state} in the cluster"
            )
        return stored

    async def catch_up(self) -> None:
        try:
            _, revision = await self._etcd("read", lambda c: c.get_prefix(self._keys.leader))
        except EtcdError:
            return
        await self._catch_up(revision)

    async def _catch_up(self, revision: int) -> None:
        """Until this replica's view has applied ``revision`` (bounded by the etcd timeout)."""
        deadline = time.monotonic() + min(2.0, self._ttl / 2)
        while self.view.revision < revision and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.view.changed(), deadline - time.monotonic())

    def _taken(self, conversion_id: str) -> bool:
        """Whether the shared record of this replica's conversion's worker names another
        conversion now, or none (settled by another replica after this one's lease lapsed)."""
        own = self._own.get(conversion_id)
        if own is None:
            return False
        current = self.view.records.get(own[0])
        if current is None or current.mod_revision <= own[1].mod_revision:
            # The view has not applied this replica's own write yet (its watch lags, as right
            # after etcd came back): what it holds is older than the claim and proves nothing.
            return False
        return current.record.conversion != conversion_id

    async def mark_switching(self, worker: Worker, conversion_id: str) -> bool:
        own = self._own.get(conversion_id)
        if own is None:
            return True
        url, stored = own
        switching = stored.record.evolve(state=WorkerState.SWITCHING.value)
        key = stored.key
        try:
            result = await self._etcd(
                "switching",
                lambda c: c.txn(
                    [if_unchanged(key, stored.mod_revision)],
                    [put_op(key, switching.encode(), lease=stored.lease)],
                ),
            )
        except EtcdError as exc:
            log.info("conversion %s: switching not shown to peers: %s", conversion_id, exc)
            return True
        if not result.succeeded:
            return False
        self._own[conversion_id] = (
            url, StoredRecord(switching, key, result.revision, stored.lease)
        )  # fmt: skip
        return True

    async def wait_peers_drained(
        self,
        worker: Worker,
        conversion_id: str,
        abort: asyncio.Event,
        deadline: float,
        waiting: Callable[[list[str]], None],
    ) -> list[str]:
        aborted = asyncio.ensure_future(abort.wait())
        try:
            while True:
                if self._taken(conversion_id):
                    raise ConversionTaken(conversion_id)
                missing = sorted(
                    self.view.replicas
                    - {self.replica_id}
                    - self.view.drained.get(conversion_id, set())
                )
                waiting(missing)
                remaining = deadline - time.monotonic()
                if not missing or abort.is_set() or remaining <= 0:
                    return missing
                changed = asyncio.ensure_future(self.view.changed())
                try:
                    await asyncio.wait(
                        {changed, aborted}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    changed.cancel()
        finally:
            aborted.cancel()

    async def release(
        self,
        worker: Worker,
        conversion_id: str,
        state: WorkerState,
        role: Role,
        bootstrap_port: int | None,
    ) -> None:
        own = self._own.get(conversion_id)
        if own is None:
            return
        url, stored = own
        record = stored.record
        port = (bootstrap_port or record.bootstrap_port) if role is Role.PREFILL else None
        key = stored.key
        released = record.released(state.value, role.value, port)
        ops = self._ending(url, stored, released, conversion_id)
        slot = self._slots.pop(conversion_id, None)
        if slot is not None:
            ops.append(delete_op(slot))
        compares = [if_unchanged(key, stored.mod_revision)]
        try:
            result = await self._etcd("release", lambda c: c.txn(compares, ops))
        except EtcdError as exc:
            log.warning(
                "conversion %s: outcome not published yet (%s); retrying", conversion_id, exc
            )
            self._released[conversion_id] = None
            self._spawn(self._release_later(conversion_id, compares, ops))
            return
        if result.succeeded:
            self._released[conversion_id] = result.revision
        else:
            log.warning(
                "conversion %s: another replica settled worker %s meanwhile; its record stands",
                conversion_id, worker.url,
            )  # fmt: skip

    async def _release_later(self, conversion_id: str, compares: list, ops: list) -> None:
        backoff = Backoff(RETRY_INITIAL_SECS, RETRY_MAX_SECS)
        while True:
            await backoff.sleep()
            try:
                await self._etcd("release", lambda c: c.txn(compares, ops))
            except EtcdError:
                continue
            log.info("conversion %s: outcome published", conversion_id)
            return

    def finished(self, worker: Worker, conversion_id: str) -> None:
        """The conversion let the worker go here: its record applies again (another replica
        may have settled it meanwhile). Until this replica's view holds the outcome it
        published, the view's record is the one from before the conversion: the echo of the
        outcome applies it instead (applied now, the worker would go back to its old pool
        until the echo came)."""
        own = self._own.pop(conversion_id, None)
        published = conversion_id in self._released
        revision = self._released.pop(conversion_id, None)
        self.mirror.own_conversions.discard(conversion_id)
        if own is None:
            return
        if not published or (revision is not None and self.view.revision >= revision):
            self.mirror.changed(own[0])

    async def _report_drained(self, conversion_id: str) -> None:
        """Say that this replica has nothing in flight on the worker ``conversion_id`` drains
        (under its lease: a replica that goes takes its reports with it)."""
        key = self._keys.drain_report(conversion_id, self.replica_id)
        backoff = Backoff(RETRY_INITIAL_SECS, RETRY_MAX_SECS)
        while True:
            try:
                await self._etcd("report", lambda c: c.put(key, b"", lease=self._lease or 0))
                return
            except EtcdError:
                await backoff.sleep()

    # --- orphans: conversions whose replica went ---------------------------------------------

    async def _settle_orphans_soon(self) -> None:
        await asyncio.sleep(ORPHAN_GRACE_SECS)
        self._settle_orphans()

    def _settle_orphans(self) -> None:
        for url, stored in list(self.view.records.items()):
            conversion = stored.record.conversion
            if (
                conversion is not None
                and conversion not in self.mirror.own_conversions
                and url not in self.view.locks
                and url not in self._settling
            ):
                self._settling.add(url)
                self._spawn(self._settle(url, stored))

    async def _settle(self, url: str, stored: StoredRecord) -> None:
        """Lock an orphaned worker, read its live role and publish it, ending the conversion
        its dead replica started (finished if the switch took effect, else rolled back)."""
        record = stored.record
        key, lock = stored.key, self._keys.lock(url)
        value = orjson.dumps({"conversion": record.conversion, "replica": self.replica_id})
        try:
            locked = await self._etcd(
                "settle",
                lambda c: c.txn(
                    [if_absent(lock), if_unchanged(key, stored.mod_revision)],
                    [put_op(lock, value, lease=self._lease or 0)],
                ),
            )
            if not locked.succeeded:
                return
            worker = self._registry.get(url)
            if self._settle_orphan is None:
                return
            role, port = await self._settle_orphan(worker, Role(record.role))
            port = port if role is Role.PREFILL else None
            settled = record.released(WorkerState.ACTIVE.value, role.value, port)
            ops = self._ending(url, stored, settled, record.conversion or "")
            await self._etcd(
                "settle", lambda c: c.txn([if_unchanged(key, stored.mod_revision)], ops)
            )
            log.warning(
                "conversion %s of worker %s lost its replica %s; settled as %s",
                record.conversion, url, record.owner, role.value,
            )  # fmt: skip
        except EtcdError as exc:
            log.warning("could not settle worker %s yet: %s", url, exc)
        finally:
            self._settling.discard(url)

    # --- workers added and removed through this replica --------------------------------------

    async def add_worker(self, url: str, role: Role, bootstrap_port: int | None) -> Worker:
        """Published first; the record's echo may have brought the worker into this replica's
        registry before the publication answered, else it is added here. A worker serving here
        without a record (its grace period, or the last of its pool) gets its record back."""
        registry = self._registry
        if not self.mirror.without_record(normalize_url(url)):
            registry.check_addable(url)
        with self._agreement("adding workers"):
            await self._add_worker(url, role, bootstrap_port)
        try:
            worker = registry.get(url)
        except UnknownWorker:
            return registry.add(url, role, bootstrap_port, healthy=False)
        if worker.state is WorkerState.FAILED:
            return registry.add(url, role, bootstrap_port, healthy=False)
        return worker

    async def _add_worker(self, url: str, role: Role, bootstrap_port: int | None) -> None:
        record = WorkerRecord(url, role.value, bootstrap_port, source="api")
        key = self._keys.worker(url)
        if await self._etcd("add", lambda c: c.put_if_absent(key, record.encode())):
            return
        existing = await self._etcd("add", lambda c: c.get(key))
        if existing is None or WorkerRecord.decode(existing.value).state != WorkerState.FAILED:
            raise DuplicateWorker(url)
        revision = existing.mod_revision
        if not await self._etcd(
            "add", lambda c: c.put_if_unchanged(key, record.encode(), revision)
        ):
            raise DuplicateWorker(url)

    async def begin_removal(self, worker: Worker) -> None:
        """Published first, if this replica allows it; the echo may have begun the removal
        here already."""
        registry = self._registry
        registry.check_removable(worker)
        with self._agreement("removing workers"):
            await self._begin_removal(worker)
        if worker.state is not WorkerState.REMOVING:
            registry.begin_removal(worker)

    async def _begin_removal(self, worker: Worker) -> None:
        stored = self.view.records.get(worker.url)
        if stored is None:
            # Serving here without a record (its grace period, or the last of its pool): a
            # record saying it is being removed tells the other replicas too.
            removing = WorkerRecord(
                worker.url, worker.role.value, worker.bootstrap_port,
                state=WorkerState.REMOVING.value, epoch=worker.epoch,
            )  # fmt: skip
            key = self._keys.worker(worker.url)
            await self._etcd("remove", lambda c: c.put_if_absent(key, removing.encode()))
            return
        removing = stored.record.evolve(state=WorkerState.REMOVING.value)
        key = stored.key
        await self._etcd(
            "remove",
            lambda c: c.put_if_unchanged(
                key, removing.encode(), stored.mod_revision, lease=stored.lease
            ),
        )

    async def end_removal(self, worker: Worker) -> None:
        stored = self.view.records.get(worker.url)
        key = stored.key if stored is not None else self._keys.worker(worker.url)
        try:
            await self._etcd("remove", lambda c: c.delete(key))
        except EtcdError as exc:
            log.warning("worker %s: removal not published: %s", worker.url, exc)

    def _publish_adopted(self, worker: Worker) -> None:
        """This replica's probes found the worker in another role: share it."""
        self._spawn(self._publish_role(worker))

    async def _publish_role(self, worker: Worker) -> None:
        try:
            stored = self._stored(worker)
        except ConversionRefused:
            return
        record = stored.record
        if record.conversion is not None or record.role == worker.role.value:
            return
        adopted = record.in_role(worker.role.value, worker.bootstrap_port)
        key = stored.key
        try:
            await self._etcd(
                "adopt",
                lambda c: c.put_if_unchanged(
                    key, adopted.encode(), stored.mod_revision, lease=stored.lease
                ),
            )
        except EtcdError as exc:
            log.info("role change of %s not shared: %s", worker.url, exc)

    # --- helpers ----------------------------------------------------------------------------

    def _ending(
        self, url: str, stored: StoredRecord, record: WorkerRecord, conversion_id: str
    ) -> list[Operation]:
        """The operations that end a conversion: its outcome in the record (under the
        record's own lease), its lock and its drain reports gone."""
        return [
            put_op(stored.key, record.encode(), lease=stored.lease),
            delete_op(self._keys.lock(url)),
            delete_prefix_op(self._keys.drained(conversion_id)),
        ]

    def _stored(self, worker: Worker) -> StoredRecord:
        stored = self.view.records.get(worker.url)
        if stored is not None:
            return stored
        raise ConversionRefused("unknown_worker", f"worker {worker.url} has no cluster record")

    @contextlib.contextmanager
    def _agreement(self, what: str) -> Iterator[None]:
        """A step the other replicas must agree to: refused (503) while etcd is away."""
        unavailable = ClusterUnavailable(
            f"{what} need the cluster's agreement and etcd ({', '.join(self._endpoints)}) is "
            "not reachable; routing continues"
        )
        if not self._up:
            raise unavailable
        try:
            yield
        except EtcdError as exc:
            raise unavailable from exc

    async def _etcd(
        self,
        operation: str,
        call: Callable[Concatenate[EtcdClient, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> T:
        """``call(client, *args, **kwargs)`` on the endpoint in use, then on the others if it
        cannot be reached (a loop passes its values as ``args`` to a client method rather than
        binding them in a lambda)."""
        last: EtcdUnavailable | None = None
        for _ in range(len(self._clients)):
            try:
                return await call(self._clients[self._current], *args, **kwargs)
            except EtcdUnavailable as exc:
                last = exc
                self._current = (self._current + 1) % len(self._clients)
            except EtcdError:
                self._metrics.cluster_etcd_errors_total.labels(operation).inc()
                raise
        self._metrics.cluster_etcd_errors_total.labels(operation).inc()
        raise last or EtcdUnavailable("no etcd endpoint")

    def _set_up(self, up: bool) -> None:
        self._up = up
        self._metrics.cluster_etcd_up.set(1 if up else 0)
        self._export()

    def _export(self) -> None:
        self._metrics.cluster_replicas.set(len(self.view.replicas))
        self._metrics.cluster_leader.set(1 if self.is_leader() else 0)
