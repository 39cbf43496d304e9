"""The ``[cluster]`` section: where the replicas of one cluster meet."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from pd_protocol.cluster import DEFAULT_LEASE_TTL_SECS, DEFAULT_PREFIX


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ClusterConfig:
    # etcd client endpoints (the first that answers is used); empty: a single router.
    etcd: tuple[str, ...] = ()
    name: str = ""
    prefix: str = DEFAULT_PREFIX
    # How long a dead replica's claims (conversion locks, leadership) outlive it.
    lease_ttl_secs: int = DEFAULT_LEASE_TTL_SECS
    replica_id: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)
