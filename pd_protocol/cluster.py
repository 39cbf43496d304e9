"""How router replicas and self-registering workers lay out one cluster's state in etcd.

Every key of a cluster lives under ``<prefix>/<name>/`` (:class:`ClusterKeys`):

- ``workers/<url>``: one :class:`WorkerRecord` per worker (JSON). A worker that registered
  itself keeps its record under its own lease, so the record goes when the worker dies; a
  worker from a router's configuration or admin API has no lease.
- ``replicas/<id>``: one per live router replica, under the replica's lease.
- ``locks/<url>``: the conversion that holds a worker (one at a time), under the lease of the
  replica running it; ``slots/<n>``: the cluster-wide cap on conversions, one key per running
  conversion, under the same lease.
- ``drained/<conversion>/<replica>``: a replica has no request left in flight on the worker
  that conversion drains.
- ``leader``: the replica whose autopilot runs, under its lease.

Urls in keys are percent-encoded, so a key never holds a second ``/``-separated level.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any
from urllib.parse import quote, unquote

import orjson

DEFAULT_PREFIX = "/pd-router"
DEFAULT_LEASE_TTL_SECS = 5

# A regular (non-PD) worker is never converted; its record only says it is one.
ROLES = ("prefill", "decode", "regular")
STATES = ("active", "draining", "switching", "failed", "removing")


def record_role(mode: str) -> str:
    """The role a record names for a server in SGLang's disaggregation ``mode``: a regular
    server's ``null`` is ``regular``."""
    return "regular" if mode == "null" else mode


class BadRecord(ValueError):
    """A stored value that is not a worker record (written by something else)."""


@dataclass(frozen=True)
class WorkerRecord:
    """What every replica agrees on about one worker: its pool, its state, which conversion
    holds it. Health and in-flight counts are each replica's own and are not shared."""

    url: str
    role: str
    bootstrap_port: int | None = None
    state: str = "active"
    epoch: int = 0
    # The conversion holding the worker (DRAINING or SWITCHING), the replica running it and
    # the role it converts to.
    conversion: str | None = None
    owner: str | None = None
    to_role: str | None = None
    # Who put the record there first: "config", "api" or "self" (the worker itself).
    source: str = "api"

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> WorkerRecord:
        try:
            data = orjson.loads(raw)
            record = cls(**data)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise BadRecord(f"not a worker record: {raw[:200]!r}") from exc
        if record.role not in ROLES or record.state not in STATES:
            raise BadRecord(f"worker record with role {record.role!r}, state {record.state!r}")
        return record

    def evolve(self, **changes: Any) -> WorkerRecord:
        return replace(self, **changes)

    def in_role(self, role: str, bootstrap_port: int | None) -> WorkerRecord:
        """This record with ``role`` and ``bootstrap_port``; the epoch counts role changes."""
        epoch = self.epoch if role == self.role else self.epoch + 1
        return replace(self, role=role, bootstrap_port=bootstrap_port, epoch=epoch)

    def released(self, state: str, role: str, bootstrap_port: int | None) -> WorkerRecord:
        """Let go by the conversion that held it: ``state`` under ``role``."""
        moved = self.in_role(role, bootstrap_port)
        return replace(moved, state=state, conversion=None, owner=None, to_role=None)


@dataclass(frozen=True)
class ClusterKeys:
    """The etcd keys of cluster ``name`` under ``prefix``."""

    name: str
    prefix: str = DEFAULT_PREFIX

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.name}/"

    @property
    def workers(self) -> str:
        return self.root + "workers/"

    @property
    def replicas(self) -> str:
        return self.root + "replicas/"

    @property
    def locks(self) -> str:
        return self.root + "locks/"

    @property
    def slots(self) -> str:
        return self.root + "slots/"

    @property
    def leader(self) -> str:
        return self.root + "leader"

    def worker(self, url: str) -> str:
        return self.workers + quote(url, safe="")

    def replica(self, replica_id: str) -> str:
        return self.replicas + quote(replica_id, safe="")

    def lock(self, url: str) -> str:
        return self.locks + quote(url, safe="")

    def slot(self, index: int) -> str:
        return f"{self.slots}{index}"

    def drained(self, conversion: str) -> str:
        """The prefix of one conversion's drain reports."""
        return f"{self.root}drained/{quote(conversion, safe='')}/"

    def drain_report(self, conversion: str, replica_id: str) -> str:
        return self.drained(conversion) + quote(replica_id, safe="")

    @staticmethod
    def last_part(key: str) -> str:
        """The url or id a key ends with (decoded)."""
        return unquote(key.rsplit("/", 1)[-1])
