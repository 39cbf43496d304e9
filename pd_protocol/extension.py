"""The extension endpoints (`/pd_role`, `/pd_drain`, `/convert_pd_role`, `/pd_forget_prefill`),
written once.

SGLang's in-process role switch leaves draining to the caller and says nothing about idleness or
the bootstrap port. This module adds those on top of any server that can report its role and load
and switch in process (a `RoleBackend`): SGLang's tokenizer manager in `server_patch`, the
reference engine in `pd_worker`. It imports no web framework: each server maps its HTTP routes
onto `PDExtension` and turns `ExtensionError` into a 4xx reply, so the router's tests against
pd_worker exercise the same code that runs on SGLang. The endpoints are described in
docs/server_patch.md; the paths, fields and knobs both sides share are in `pd_protocol.wire`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from pd_protocol.wire import (
    CONVERT_FIELDS,
    DEFAULT_DRAIN_TIMEOUT_SECS,
    FORGET_PREFILL_FIELDS,
    MISDIRECTED_STATUS,
    ROLES,
    ROUTING_FIELDS,
    SWITCH_FIELDS,
    UNSUPPORTED_KNOBS,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    """A server's load as the extension needs it.

    `idle` means what SGLang's `Scheduler.is_fully_idle()` means: nothing running, waiting, or
    in the bootstrap, transfer and inflight queues; only then does the native switch accept.
    """

    num_running: int
    num_waiting: int
    idle: bool


class RoleBackend(Protocol):
    """What the extension needs from a server: SGLang's tokenizer manager or pd_worker's engine."""

    async def current_role(self) -> str:
        """The live role, "prefill" or "decode"."""
        ...

    async def load(self) -> Load:
        """The live load."""
        ...

    async def switch_role(self, request: dict) -> dict:
        """Native /pd_role_switch: body in, reply out
        (`success`, `message`, `old_role`, `new_role`, `safe_to_restore`)."""
        ...

    def bootstrap_port(self) -> int | None:
        """The KV bootstrap port a decode server contacts while this server is a prefill."""
        ...

    def switch_supported(self) -> bool:
        """Whether the in-process switch is enabled (`--enable-pd-role-switch`)."""
        ...

    async def forget_prefill(self, bootstrap_host: str, bootstrap_port: int) -> None:
        """Drop what this server cached about the prefill whose KV bootstrap server is at
        `bootstrap_host`:`bootstrap_port` (nothing to drop on a prefill); raises
        `ExtensionError` when the server could not be asked."""
        ...


class ExtensionError(Exception):
    """A request the extension refuses before changing anything (bad body, unknown field, ...)."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"success": False, "message": message, "field": field}


@dataclass(frozen=True)
class _ConvertRequest:
    """A validated /convert_pd_role body."""

    new_role: str | None
    drain_timeout_secs: float
    switch_body: dict[str, Any]


def misdirected_body(expected: str, live: str) -> dict[str, Any]:
    """The 421 reply to a generation request sent for `expected` to a server now in `live`:
    SGLang's error shape, plus the live role at the top level for the router to act on."""
    return {
        "error": {
            "message": f"this server is a {live} server, not a {expected} server",
            "type": "misdirected_request",
            "code": MISDIRECTED_STATUS,
        },
        "role": live,
    }


def expected_role(value: str | None) -> str | None:
    """The role a `ROLE_HEADER` value names, or None when it names none (header ignored)."""
    if value is None:
        return None
    role = value.strip().lower()
    return role if role in ROLES else None


def other_role(role: str) -> str:
    """The role a server converts to when the caller does not name one."""
    return "decode" if role == "prefill" else "prefill"


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ExtensionError("request body must be a JSON object")
    return body


def _check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """Refuse knobs the in-process switch cannot honour and fields nobody defined."""
    for name, value in body.items():
        if name in UNSUPPORTED_KNOBS:
            if value is None or value is False:
                continue
            raise ExtensionError(
                f"{name} cannot be changed by an in-process role switch; restart the server "
                "with the new setting instead",
                field=name,
            )
        if name not in allowed and name not in ROUTING_FIELDS:
            raise ExtensionError(f"unknown field {name!r}", field=name)


def _role_field(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or value.lower() not in ROLES:
        raise ExtensionError(f"{name} must be 'prefill' or 'decode'", field=name)
    return value.lower()


def _number_field(body: dict[str, Any], name: str, *, signed: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or (value < 0 and not signed):
        raise ExtensionError(f"{name} must be a non-negative number", field=name)
    return float(value)


def _switch_body(
    body: dict[str, Any], new_role: str | None, *, native: bool = False
) -> dict[str, Any]:
    """The native /pd_role_switch body, with its optional fields type-checked. On the native
    route a negative ``decode_cuda_graph_memory_gb`` is the server's to refuse, as SGLang does
    (in its own words, and only when the switch would capture decode graphs)."""
    switch: dict[str, Any] = {"new_role": new_role or ""}
    graph_bs = body.get("decode_cuda_graph_bs")
    if graph_bs is not None:
        if not isinstance(graph_bs, list) or not all(
            isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 for bs in graph_bs
        ):
            raise ExtensionError(
                "decode_cuda_graph_bs must be a list of positive integers",
                field="decode_cuda_graph_bs",
            )
        switch["decode_cuda_graph_bs"] = graph_bs
    memory_gb = _number_field(body, "decode_cuda_graph_memory_gb", signed=native)
    if memory_gb is not None:
        switch["decode_cuda_graph_memory_gb"] = memory_gb
    return switch


def parse_switch_body(body: object) -> dict[str, Any]:
    """Validate a native /pd_role_switch body; `new_role` is required there, spelled exactly
    as SGLang's request type allows (it refuses "Decode" before its handler runs)."""
    body = _require_object(body)
    _check_fields(body, SWITCH_FIELDS)
    new_role = body.get("new_role")
    if new_role is None:
        raise ExtensionError("new_role is required", field="new_role")
    if new_role not in ROLES:
        raise ExtensionError("new_role must be 'prefill' or 'decode'", field="new_role")
    return _switch_body(body, new_role, native=True)


def _parse_convert_body(body: object, bootstrap_port: int | None) -> _ConvertRequest:
    """Validate a /convert_pd_role body: ours or the SGLang PR #9325 shape."""
    body = _require_object(body)
    _check_fields(body, CONVERT_FIELDS)
    new_role = _role_field(body, "new_role")
    alias = _role_field(body, "disaggregation_mode")
    if new_role is not None and alias is not None and new_role != alias:
        raise ExtensionError(
            "new_role and disaggregation_mode name different roles", field="disaggregation_mode"
        )
    for name in ("bootstrap_port", "disaggregation_bootstrap_port"):
        port = body.get(name)
        if port is not None and port != bootstrap_port:
            raise ExtensionError(
                f"{name} cannot be changed by an in-process role switch "
                f"(this server's bootstrap port is {bootstrap_port})",
                field=name,
            )
    if body.get("check_idle") is False:
        raise ExtensionError(
            "check_idle false cannot be honoured: SGLang switches roles only when idle",
            field="check_idle",
        )
    timeout = _number_field(body, "drain_timeout_secs")
    role = new_role or alias
    return _ConvertRequest(
        new_role=role,
        drain_timeout_secs=DEFAULT_DRAIN_TIMEOUT_SECS if timeout is None else timeout,
        switch_body=_switch_body(body, role),
    )


def _parse_forget_prefill_body(body: object) -> tuple[str, int]:
    """Validate a /pd_forget_prefill body: the prefill's bootstrap host and port."""
    body = _require_object(body)
    for name in body:
        if name not in FORGET_PREFILL_FIELDS:
            raise ExtensionError(f"unknown field {name!r}", field=name)
    host = body.get("bootstrap_host")
    if not isinstance(host, str) or not host.strip():
        raise ExtensionError("bootstrap_host must be a non-empty string", field="bootstrap_host")
    port = body.get("bootstrap_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ExtensionError("bootstrap_port must be a port number", field="bootstrap_port")
    return host.strip(), port


def _parse_drain_body(body: object) -> bool:
    body = _require_object(body)
    for name in body:
        if name != "drain":
            raise ExtensionError(f"unknown field {name!r}", field=name)
    drain = body.get("drain", True)
    if not isinstance(drain, bool):
        raise ExtensionError("drain must be true or false", field="drain")
    return drain


class PDExtension:
    """Drain gate, wait-for-idle, convert and status over one `RoleBackend`.

    Admission is closed while an operator drain is set (`/pd_drain`) or a conversion runs, so a
    second router cannot slip traffic in while one drains the server. After a switch that failed
    without `safe_to_restore`, the server is half torn down: admission stays closed for good and
    `failed` is true, so the server's health route can report it.

    The live role is read from the backend once and then kept by the switches, which all go
    through this object (both servers route `/pd_role_switch` here): the admission check of
    `misdirected` runs on every generation request and must not cost a scheduler round trip.
    `started_at` (wall clock, created with the server process) lets a router tell a restarted
    server from one that kept running, since the epoch starts again at 0.
    """

    def __init__(self, backend: RoleBackend, *, idle_poll_interval: float = 0.02) -> None:
        self._backend = backend
        self._started_at = time.time()
        self._role: str | None = None
        # The last role read from the backend or switched to; unlike `_role` it is not
        # cleared by a switch, so synchronous readers always have the latest one seen.
        self._last_role: str | None = None
        self._idle_poll_interval = idle_poll_interval
        self._drain_requested = False
        self._converting = False
        self._failed = False
        self._epoch = 0
        self._load_event = asyncio.Event()
        self._switch_lock = asyncio.Lock()

    @property
    def draining(self) -> bool:
        """Whether new generation requests are refused right now."""
        return self._drain_requested or self._converting or self._failed

    @property
    def epoch(self) -> int:
        """How many times this server actually changed role since it started."""
        return self._epoch

    @property
    def failed(self) -> bool:
        """Whether a switch failed without `safe_to_restore` (restart required)."""
        return self._failed

    @property
    def known_role(self) -> str | None:
        """The latest role read from the backend or switched to, without asking the backend
        (None before the first read): for callers that cannot await, such as the etcd
        self-registration reading the role it puts in the worker's record."""
        return self._role or self._last_role

    def bootstrap_port(self) -> int | None:
        """The server's KV bootstrap port (as /pd_role reports it)."""
        return self._backend.bootstrap_port()

    def admits(self) -> bool:
        """Whether a new generation request may enter (else: 503 with Retry-After)."""
        return not self.draining

    async def live_role(self) -> str:
        """The live role: read from the backend, then kept until the next switch (reading it
        costs SGLang a round trip to its schedulers). A read that a switch overtook is returned
        but not kept."""
        if self._role is not None:
            return self._role
        epoch = self._epoch
        role = await self._backend.current_role()
        if self._role is None and epoch == self._epoch:
            self._role = self._last_role = role
        return role

    async def misdirected(self, header: str | None) -> dict[str, Any] | None:
        """The `MISDIRECTED_STATUS` reply body when a generation request whose `ROLE_HEADER`
        is `header` was sent for the other role than the live one; None when it may go on."""
        expected = expected_role(header)
        if expected is None:
            return None
        live = await self.live_role()
        return None if live == expected else misdirected_body(expected, live)

    def load_changed(self) -> None:
        """Wake a waiting drain at once; backends call it whenever their load changes."""
        self._load_event.set()

    async def status(self) -> dict[str, Any]:
        """The GET /pd_role reply."""
        epoch = self._epoch
        role = await self._backend.current_role()
        if epoch == self._epoch:
            self._last_role = role
        load = await self._backend.load()
        return {
            "role": role,
            "bootstrap_port": self._backend.bootstrap_port(),
            "idle": load.idle,
            "num_running": load.num_running,
            "num_waiting": load.num_waiting,
            "draining": self.draining,
            "epoch": self._epoch,
            "switch_supported": self._backend.switch_supported(),
            "started_at": self._started_at,
        }

    async def set_drain(self, body: object) -> dict[str, Any]:
        """POST /pd_drain: close (`drain` true, the default) or reopen admission; status() after."""
        drain = _parse_drain_body(body)
        if drain != self._drain_requested:
            logger.info("admission %s by /pd_drain", "closed" if drain else "reopened")
        self._drain_requested = drain
        return await self.status()

    async def forget_prefill(self, body: object) -> dict[str, Any]:
        """POST /pd_forget_prefill: the server drops its cached endpoints of one prefill, so
        the next request from that prefill fetches them from its bootstrap server again (after
        the prefill went through decode and back, the old ones lead nowhere)."""
        host, port = _parse_forget_prefill_body(body)
        await self._backend.forget_prefill(host, port)
        logger.info("forgot the endpoints of prefill %s:%d", host, port)
        return {"success": True, "message": f"forgot prefill {host}:{port}"}

    async def switch(self, body: object) -> tuple[int, dict[str, Any]]:
        """Native POST /pd_role_switch through the extension, so the epoch counts it."""
        request = parse_switch_body(body)
        if self._switch_lock.locked():
            old_role = await self._backend.current_role()
            return 400, self._busy_reply(request["new_role"], old_role)
        async with self._switch_lock:
            reply = await self._switch(request)
        return (200 if reply["success"] else 400), reply

    async def convert(self, body: object) -> tuple[int, dict[str, Any]]:
        """POST /convert_pd_role: close admission, wait until idle, switch, reopen admission."""
        request = _parse_convert_body(body, self._backend.bootstrap_port())
        if self._switch_lock.locked():
            old_role = await self._backend.current_role()
            busy = self._busy_reply(request.new_role or other_role(old_role), old_role)
            return 409, dict(busy, bootstrap_port=self._backend.bootstrap_port(), duration_s=0.0)
        async with self._switch_lock:
            started = time.monotonic()
            old_role = await self._backend.current_role()
            new_role = request.new_role or other_role(old_role)
            reply = await self._convert(request, old_role, new_role)
            reply["bootstrap_port"] = self._backend.bootstrap_port()
            reply["duration_s"] = round(time.monotonic() - started, 6)
        return (200 if reply["success"] else 400), reply

    async def _convert(
        self, request: _ConvertRequest, old_role: str, new_role: str
    ) -> dict[str, Any]:
        refusal = self._refusal(old_role, new_role)
        if refusal is not None:
            return refusal
        if new_role == old_role:
            return _reply(True, "already in target role", old_role, new_role, safe=True)
        self._converting = True
        logger.info("conversion %s -> %s: admission closed, draining", old_role, new_role)
        try:
            return await self._drain_and_switch(request, old_role, new_role)
        finally:
            self._converting = False
            self._drain_requested = False
            logger.info("conversion %s -> %s ended: admission reopened", old_role, new_role)

    async def _drain_and_switch(
        self, request: _ConvertRequest, old_role: str, new_role: str
    ) -> dict[str, Any]:
        """Wait for idle, then switch; wait again if a request admitted just before the gate
        closed reached the scheduler after the idle reading and the switch was refused for it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.drain_timeout_secs
        switch_body = dict(request.switch_body, new_role=new_role)
        while True:
            load = await self._wait_idle(deadline)
            if not load.idle:
                return _reply(
                    False,
                    f"drain timed out after {request.drain_timeout_secs:g}s with "
                    f"{load.num_running} running and {load.num_waiting} waiting requests",
                    old_role,
                    new_role,
                    safe=True,
                )
            reply = await self._switch(switch_body)
            if reply.get("success") or not reply.get("safe_to_restore"):
                return reply
            if (await self._backend.load()).idle:
                return reply

    def _refusal(self, old_role: str, new_role: str) -> dict[str, Any] | None:
        """Why a conversion cannot start at all (nothing is drained then), or None."""
        if self._failed:
            return _reply(
                False,
                "instance is unhealthy after a failed role switch; restart required",
                old_role,
                new_role,
                safe=False,
            )
        if not self._backend.switch_supported():
            return _reply(
                False,
                "--enable-pd-role-switch is not set on this instance",
                old_role,
                new_role,
                safe=True,
            )
        return None

    async def _switch(self, request: dict[str, Any]) -> dict[str, Any]:
        """Call the backend's native switch and account for the outcome (epoch, failed)."""
        reply = await self._backend.switch_role(request)
        success = bool(reply.get("success"))
        # Whatever the reply claims, the live role is read again from the backend next time (a
        # failed or misreported switch may have left it anywhere).
        self._role = None
        if success and reply.get("new_role") in ROLES:
            self._last_role = reply["new_role"]
        if success and reply.get("old_role") != reply.get("new_role"):
            self._epoch += 1
            logger.info(
                "role switched %s -> %s (epoch %d)",
                reply.get("old_role"),
                reply.get("new_role"),
                self._epoch,
            )
        elif not success and not reply.get("safe_to_restore"):
            self._failed = True
            logger.error("role switch failed unsafely: %s", reply.get("message"))
        return reply

    async def _wait_idle(self, deadline: float) -> Load:
        """Wait until the backend is idle or the loop clock passes `deadline`; returns the last
        load seen.

        Wakes on `load_changed()` at once; without such calls it re-reads the load every
        `idle_poll_interval` seconds.
        """
        loop = asyncio.get_running_loop()
        while True:
            self._load_event.clear()
            load = await self._backend.load()
            remaining = deadline - loop.time()
            if load.idle or remaining <= 0:
                return load
            try:
                await asyncio.wait_for(
                    self._load_event.wait(), min(remaining, self._idle_poll_interval)
                )
            except TimeoutError:
                continue

    @staticmethod
    def _busy_reply(new_role: str, old_role: str) -> dict[str, Any]:
        return _reply(
            False,
            "another role switch or conversion is already running",
            old_role,
            new_role,
            safe=True,
        )


def _reply(
    success: bool, message: str, old_role: str, new_role: str, *, safe: bool
) -> dict[str, Any]:
    """A reply in the native /pd_role_switch shape."""
    return {
        "success": success,
        "message": message,
        "old_role": old_role,
        "new_role": new_role,
        "safe_to_restore": safe,
    }
