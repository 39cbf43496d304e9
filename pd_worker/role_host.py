"""What a role object needs from the engine that outlives it.

Role objects (:mod:`pd_worker.roles`, :mod:`pd_worker.torch_roles`) are built by a data plane for
the :class:`~pd_worker.engine.Engine`, which in turn builds its data plane; the roles depend on
this protocol instead of the engine, so neither module imports the other.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from pd_worker.bootstrap import RoomRegistry
from pd_worker.faults import Faults
from pd_worker.kvpool import KVPool
from pd_worker.prefix_cache import PrefixCache
from pd_worker.requests import Req
from pd_worker.stats import EngineStats
from pd_worker.timing import TimingModel


class RoleHost(Protocol):
    """The engine's long-lived state a role reads and the bookkeeping it reports to."""

    timing: TimingModel
    faults: Faults
    stats: EngineStats
    kv_pool: KVPool
    prefix_cache: PrefixCache
    rooms: RoomRegistry
    running_slots: asyncio.Semaphore

    @property
    def num_running(self) -> int:
        """Requests in a decode step or prefill forward right now (the batch a step serves)."""
        ...

    def set_stage(self, req: Req, stage: str | None) -> None:
        """Move a request between queues (None: it left the engine)."""
        ...

    def check_fits(self, tokens: int) -> None:
        """Raise BadRequest when ``tokens`` exceed the KV pool's capacity."""
        ...
