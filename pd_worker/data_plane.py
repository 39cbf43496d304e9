"""The seam between the worker's control plane and what its KV and tokens are made of.

The :class:`~pd_worker.engine.Engine` (queues, loads, bootstrap listener, role switch) is the same
for every engine; a :class:`DataPlane` supplies what differs: the role objects that compute,
hold, pull and generate, and the resources that outlive role switches (a model's weights and KV
pool). :class:`TimingPlane` is the reference worker's timing model with a digest for KV; the torch
plane (:mod:`pd_worker.torch_plane`) runs a real model over a real KV pool.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pd_worker.bootstrap import Room
from pd_worker.config import REGULAR_MODE
from pd_worker.requests import GenItem, Progress, Req
from pd_worker.role_host import RoleHost
from pd_worker.roles import DecodeRole, PrefillRole, RegularRole
from pd_worker.timing import TimingModel
from pd_worker.tokens import tokenize


class PlaneUnavailable(RuntimeError):
    """The chosen data plane cannot run here (its packages missing, its transport refusing to
    start); the worker fails with the reason instead of serving another way."""


class Role(Protocol):
    """One mode of a worker (prefill, decode, or a regular server's both), torn down and rebuilt
    on every role switch."""

    name: str

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens waiting for a prefill forward (SGLang's uncached waiting tokens)."""
        ...

    def start(self) -> None: ...

    async def teardown(self) -> None: ...

    async def run(self, item: GenItem, req: Req, emit: Callable[[Progress], None]) -> None: ...


class DataPlane(Protocol):
    """What an engine kind provides to the :class:`~pd_worker.engine.Engine`."""

    kind: str

    def make_role(self, host: RoleHost, role: str) -> Role:
        """A fresh role object of ``role`` over this plane's and ``host``'s long-lived
        resources."""
        ...

    async def before_send(self, room: Room) -> None:
        """Runs as the bootstrap server hands a room's payload to a decode."""
        ...

    async def after_teardown(self) -> None:
        """Runs between a switch's teardown of the old role and the build of the new one."""
        ...

    def tokenize(self, text: str) -> list[int]:
        """A text prompt's token ids for this plane's model."""
        ...

    def state(self) -> dict[str, Any] | None:
        """``GET /torch_state`` (None: this plane has no tensors to report)."""

    async def close(self) -> None:
        """The worker stops: release what outlives the role objects."""
        ...


class TimingPlane:
    """The timing model: forwards and steps are modeled waits, the KV is a digest of the prompt."""

    kind = "timing"

    def __init__(self, timing: TimingModel) -> None:
        self._timing = timing

    def make_role(self, host: RoleHost, role: str) -> Role:
        roles: dict[str, Callable[[RoleHost], Role]] = {
            "prefill": PrefillRole,
            "decode": DecodeRole,
            REGULAR_MODE: RegularRole,
        }
        return roles[role](host)

    async def before_send(self, room: Room) -> None:
        """The modeled time the KV of the room's tokens takes over the wire."""
        await self._timing.wait(self._timing.transfer_secs(room.num_tokens))

    async def after_teardown(self) -> None:
        """The modeled time the rest of a real switch takes (``switch_secs``)."""
        await self._timing.wait(self._timing.switch_secs)

    def tokenize(self, text: str) -> list[int]:
        """The toy tokenizer: one token per UTF-8 byte."""
        return tokenize(text)

    def state(self) -> dict[str, Any] | None:
        return None

    async def close(self) -> None:
        return None
