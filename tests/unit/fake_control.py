"""A worker control with no network: the methods of
:class:`pd_router.control.worker_control.WorkerControl`, answered from a small model of each
worker (its role, admission, load and what its switch call answers), recording every call.

A test scripts a worker by setting its fields (``switch_replies`` answers the switch calls in
turn, ``gone`` makes every call fail to connect) and reads ``calls`` afterwards.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pd_protocol.wire import CONVERT_PATH, DRAIN_PATH, ROLE_PATH, SWITCH_PATH
from pd_router.control.worker_control import ControlError, LoadReading, RoleReading, SwitchReply
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.roles import Role

OK_SWITCH = SwitchReply(200, {"success": True, "message": "switched"})
CANARY_OK = (200, {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}})


@dataclass
class FakeWorker:
    """What one worker answers."""

    role: Role
    extensions: bool = False
    bootstrap_port: int | None = None
    admitting: bool = True
    running: int = 0
    # The switch calls' answers in turn; once empty, a switch succeeds and takes the role.
    switch_replies: deque[SwitchReply | ControlError] = field(default_factory=deque)
    # Set: the switch call waits for it before answering (a call that went out and hangs).
    hold_switch: asyncio.Event | None = None
    # Set: the worker reports this role after a switch, whatever it was asked for.
    role_after_switch: Role | None = None
    canary: tuple[int, Any] = CANARY_OK
    # False: a reopened admission stays closed (the worker runs a conversion of its own).
    reopens: bool = True
    # Every call fails to connect: no process listens any more.
    gone: bool = False


class FakeWorkerControl:
    """WorkerControl's methods over :class:`FakeWorker` models, keyed by url."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry
        self.workers: dict[str, FakeWorker] = {}
        self.calls: list[tuple[str, str]] = []
        self.switch_bodies: list[dict[str, Any]] = []
        self.forgotten: list[tuple[str, int | None]] = []
        self.switch_sent = asyncio.Event()

    def add(self, worker: Worker, **fields: Any) -> FakeWorker:
        model = FakeWorker(role=worker.role, bootstrap_port=worker.bootstrap_port, **fields)
        self.workers[worker.url] = model
        return model

    def _reach(self, url: str, path: str) -> FakeWorker:
        self.calls.append((url, path))
        model = self.workers[url]
        if model.gone:
            raise ControlError(url, path, "connection refused", delivered=False)
        return model

    async def detect_extensions(self, worker: Worker) -> bool:
        if worker.has_extensions is None:
            model = self._reach(worker.url, ROLE_PATH)
            self._registry.set_extensions(worker, model.extensions)
            return model.extensions
        return worker.has_extensions

    async def read_role(self, worker: Worker) -> RoleReading:
        model = self._reach(worker.url, ROLE_PATH)
        return RoleReading(
            model.role, model.bootstrap_port, draining=not model.admitting, switch_supported=True
        )

    async def read_load(self, worker: Worker) -> LoadReading:
        model = self._reach(worker.url, "/v1/loads")
        return LoadReading(model.running == 0, model.running, 0)

    async def server_info(self, url: str) -> dict[str, Any]:
        model = self._reach(url, "/server_info")
        return {"internal_states": [{"disaggregation_mode": model.role.value}]}

    async def decode_graph_params(self, url: str) -> dict[str, Any]:
        self._reach(url, "/server_info")
        return {"decode_cuda_graph_bs": [1, 2], "decode_cuda_graph_memory_gb": 1.5}

    async def set_admission(self, worker: Worker, *, open_: bool) -> None:
        model = self._reach(worker.url, DRAIN_PATH)
        model.admitting = open_ and model.reopens

    async def switch(self, worker: Worker, body: dict[str, Any]) -> SwitchReply:
        return await self._switch(worker, SWITCH_PATH, body)

    async def convert(self, worker: Worker, body: dict[str, Any]) -> SwitchReply:
        reply = await self._switch(worker, CONVERT_PATH, body)
        if reply.success:
            self.workers[worker.url].admitting = True
        return reply

    async def _switch(self, worker: Worker, path: str, body: dict[str, Any]) -> SwitchReply:
        model = self._reach(worker.url, path)
        self.switch_bodies.append(body)
        self.switch_sent.set()
        if model.hold_switch is not None:
            await model.hold_switch.wait()
        reply = model.switch_replies.popleft() if model.switch_replies else OK_SWITCH
        if isinstance(reply, ControlError):
            raise reply
        if reply.success:
            model.role = model.role_after_switch or Role(body["new_role"])
        return reply

    async def forget_prefill_on_decodes(self, prefill: Worker, bootstrap_port: int | None) -> None:
        self.forgotten.append((prefill.url, bootstrap_port))

    async def canary_leg(
        self, worker: Worker, role: Role, body: dict[str, Any], timeout_secs: float
    ) -> tuple[int, Any]:
        self._reach(worker.url, f"/generate as {role}")
        return self.workers[worker.url].canary

    async def abort_request(self, worker: Worker, rid: str) -> None:
        self.calls.append((worker.url, "/abort_request"))

    def called(self, url: str, path: str) -> int:
        return self.calls.count((url, path))
