"""A replica's copy of its cluster's keys in etcd, kept current by one watch.

It only holds what etcd said (records with their revisions and leases, live replicas,
conversion locks, drain reports, the leader) and wakes whoever waits for a change; what a change
means for the registry is :mod:`pd_router.control.cluster.mirror`'s job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from pd_protocol.cluster import BadRecord, ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import EventType, KeyValue, WatchEvent
from pd_router.control.workers import normalize_url

log = logging.getLogger("pd_router.cluster")


@dataclass(frozen=True)
class StoredRecord:
    """A worker record and where etcd has it (to compare-and-swap, to keep its lease)."""

    record: WorkerRecord
    key: str
    mod_revision: int
    lease: int


@dataclass
class ClusterView:
    keys: ClusterKeys
    # By the worker's url as the registry spells it (normalized from the url in the key).
    records: dict[str, StoredRecord] = field(default_factory=dict)
    replicas: set[str] = field(default_factory=set)
    locks: dict[str, str] = field(default_factory=dict)
    drained: dict[str, set[str]] = field(default_factory=dict)
    leader: str | None = None
    # The store revision everything above reflects.
    revision: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def reset(self, kvs: list[KeyValue], revision: int) -> None:
        """Replace everything with a full read of the cluster's keys at ``revision``."""
        self.records.clear()
        self.replicas.clear()
        self.locks.clear()
        self.drained.clear()
        self.leader = None
        for kv in kvs:
            self._store(kv)
        self.revision = revision
        self._notify()

    def apply(self, event: WatchEvent) -> str | None:
        """Take one watched change in; the url of the worker record it changed, if any."""
        self.revision = max(self.revision, event.kv.mod_revision)
        url = self._store(event.kv) if event.type is EventType.PUT else self._drop(event.kv.key)
        self._notify()
        return url

    def changed(self) -> Coroutine[Any, Any, bool]:
        """An awaitable that returns at the next change after this call. Not a coroutine
        function: it takes the current event now, so a change between the call and the first
        await (a task not yet started) still wakes it."""
        return self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _part(self, key: str) -> tuple[str, list[str]]:
        rest = key[len(self.keys.root) :].split("/")
        return rest[0], [ClusterKeys.last_part(part) for part in rest[1:]]

    def _store(self, kv: KeyValue) -> str | None:
        kind, parts = self._part(kv.key)
        value = kv.value.decode(errors="replace")
        if kind == "workers" and parts:
            try:
                record = WorkerRecord.decode(kv.value)
            except BadRecord as exc:
                log.warning("ignoring %s: %s", kv.key, exc)
                return None
            url = _worker_url(kv.key, parts[0])
            if url is not None:
                self.records[url] = StoredRecord(record, kv.key, kv.mod_revision, kv.lease)
            return url
        if kind == "replicas" and parts:
            self.replicas.add(parts[0])
        elif kind == "locks" and parts:
            self.locks[parts[0]] = value
        elif kind == "drained" and len(parts) == 2:
            self.drained.setdefault(parts[0], set()).add(parts[1])
        elif kind == "leader":
            self.leader = value
        return None

    def _drop(self, key: str) -> str | None:
        kind, parts = self._part(key)
        if kind == "workers" and parts:
            url = _worker_url(key, parts[0])
            return url if url is not None and self.records.pop(url, None) is not None else None
        if kind == "replicas" and parts:
            self.replicas.discard(parts[0])
        elif kind == "locks" and parts:
            self.locks.pop(parts[0], None)
        elif kind == "drained" and len(parts) == 2:
            reports = self.drained.get(parts[0])
            if reports is not None:
                reports.discard(parts[1])
                if not reports:
                    del self.drained[parts[0]]
        elif kind == "leader":
            self.leader = None
        return None


def _worker_url(key: str, url: str) -> str | None:
    try:
        return normalize_url(url)
    except ValueError:
        log.warning("ignoring %s: not a worker url", key)
        return None
