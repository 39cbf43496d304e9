"""Worker control adapters: how the router asks a worker about its role and makes it switch.

Two protocols exist. Native SGLang (>= 0.5.21 with ``--enable-pd-role-switch``) offers
``POST /pd_role_switch`` (refused unless the server is fully idle), ``GET /server_info`` (the live
role in ``internal_states[0].disaggregation_mode``) and ``GET /v1/loads``. Workers with the
extension endpoints (server_patch on SGLang, pd_worker) add ``GET /pd_role``, ``POST /pd_drain``
(close admission so a second router cannot slip traffic in) and ``POST /convert_pd_role`` (drain
on the server side, then switch). The router uses the extension when a worker has it and falls
back to the native protocol otherwise: the readings (role, load) hide the difference here, the
conversion's steps over each protocol are in :mod:`pd_router.control.conversion.protocols`.
Paths come from :mod:`pd_protocol.wire`.

SGLang 0.5.21-0.5.23 without server_patch crashes a server that runs a radix cache once it was
switched to decode and served requests sharing a prompt prefix (docs/sglang-bugs.md, bug a):
such a worker is warned about, naming the flag that avoids it, when its protocol is detected and
before a native switch to decode. When a worker becomes a prefill again, every
decode is asked to forget what it cached about that prefill (``POST /pd_forget_prefill``):
SGLang's decodes keep a prefill's rank endpoints keyed by its bootstrap address, and after the
prefill's round trip through decode those lead nowhere (docs/sglang-bugs.md, bug b).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pd_protocol.json_values import is_int
from pd_protocol.wire import (
    CONVERT_PATH,
    DRAIN_PATH,
    FORGET_PREFILL_PATH,
    ROLE_HEADER,
    ROLE_PATH,
    SWITCH_PATH,
)
from pd_router.control.workers import Role, Worker, WorkerRegistry
from pd_router.roles import worker_role

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECS = 10.0
# SGLang versions whose role switch keeps a radix cache enabled in decode mode (bug a): from the
# first with the switch to the last checked.
RADIX_SWITCH_CRASH_VERSIONS = ((0, 5, 21), (0, 5, 23))
DEFAULT_SWITCH_TIMEOUT_SECS = 600.0


class ControlError(Exception):
    """The worker could not be reached or answered something that is not its protocol.

    ``delivered`` is false when the connection could not even be opened: the worker never saw
    the call, so a switch call that fails this way changed nothing. ``status`` is the HTTP
    status when the worker answered, but not with what the call expects.
    """

    def __init__(
        self, url: str, path: str, reason: str, *, delivered: bool = True, status: int | None = None
    ) -> None:
        super().__init__(f"{url}{path}: {reason}")
        self.url = url
        self.path = path
        self.reason = reason
        self.delivered = delivered
        self.status = status


@dataclass(frozen=True)
class SwitchReply:
    """A worker's answer to /pd_role_switch or /convert_pd_role, kept verbatim in ``body``."""

    status: int
    body: dict[str, Any]

    @property
    def success(self) -> bool:
        return self.status == 200 and bool(self.body.get("success"))

    @property
    def safe_to_restore(self) -> bool:
        return bool(self.body.get("safe_to_restore"))

    @property
    def message(self) -> str:
        return str(self.body.get("message", ""))


class NotAWorker(ControlError):
    """The url answers as a PD router (pd-router or mini_lb: its ``/server_info`` lists prefill
    and decode pools), not as a prefill or decode worker."""

    def __init__(self, url: str) -> None:
        super().__init__(
            url,
            "/server_info",
            "this is a PD router (its /server_info lists prefill and decode pools), not a "
            "prefill or decode worker: give this router the workers behind that one",
        )


@dataclass(frozen=True)
class RoleReading:
    """The role a worker reports for itself and its KV bootstrap port, and what tells one
    server process from the next: ``instance``, its start signature (``started_at`` of
    ``/pd_role``, else the ``startup_time`` durations of ``internal_states[0]``, which differ
    from one start to the next), and ``epoch`` (extension: role changes since it started).
    ``draining`` (extension) is true while its admission is closed. ``switch_supported``: whether
    it can switch roles at all (``/pd_role``, else ``enable_pd_role_switch`` of ``/server_info``;
    None when it does not say)."""

    role: Role | None
    bootstrap_port: int | None
    epoch: int | None = None
    instance: str | None = None
    draining: bool = False
    switch_supported: bool | None = None


@dataclass(frozen=True)
class LoadReading:
    """A worker's load; ``idle`` is what the native switch accepts."""

    idle: bool
    num_running: int
    num_waiting: int


def open_control_session(ssl_context: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """The control plane's client session: a new connection for every call (``force_close``).

    Control calls are a handful per conversion, so the handshake costs nothing that matters;
    in exchange a call to a dead worker fails to connect (never delivered: nothing changed)
    instead of failing on a kept-alive connection the worker's death left behind, where
    nobody can tell whether the worker saw the call. ``ssl_context`` verifies https://
    workers (None: aiohttp's defaults).
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            force_close=True, limit=0, ssl=ssl_context if ssl_context is not None else True
        ),
        timeout=aiohttp.ClientTimeout(total=DEFAULT_SWITCH_TIMEOUT_SECS),
    )


class WorkerControl:
    """Control calls on a session from :func:`open_control_session`; what they learn about a
    worker's protocol is kept in ``registry``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        registry: WorkerRegistry,
        *,
        timeout_secs: float = DEFAULT_TIMEOUT_SECS,
        switch_timeout_secs: float = DEFAULT_SWITCH_TIMEOUT_SECS,
        headers: dict[str, str] | None = None,
    ) -> None:
        self._session = session
        self._registry = registry
        self._timeout = aiohttp.ClientTimeout(total=timeout_secs)
        self._switch_timeout = aiohttp.ClientTimeout(total=switch_timeout_secs)
        self._headers = headers or {}

    # --- discovery --------------------------------------------------------------------------

    async def detect_extensions(self, worker: Worker) -> bool:
        """Whether the worker serves ``GET /pd_role``; remembered on the worker (registry)."""
        if worker.has_extensions is None:
            status, body = await self._get(worker.url, ROLE_PATH)
            found = status == 200 and isinstance(body, dict) and "role" in body
            self._registry.set_extensions(worker, found)
            return found
        return worker.has_extensions

    # --- readings ---------------------------------------------------------------------------

    async def read_role(self, worker: Worker) -> RoleReading:
        """The worker's live role (``/pd_role``, else ``internal_states[0]`` of ``/server_info``:
        the top level of ``/server_info`` holds the launch arguments, not the live role).
        A native worker exposed to SGLang's radix-cache crash is warned about when its protocol
        is detected (registration, restart)."""
        detected = worker.has_extensions is None
        if await self.detect_extensions(worker):
            body = await self._get_ok(worker.url, ROLE_PATH)
            epoch = body.get("epoch")
            return RoleReading(
                worker_role(body.get("role")),
                _port(body.get("bootstrap_port")),
                epoch=epoch if is_int(epoch) else None,
                instance=_signature(body.get("started_at")),
                draining=body.get("draining") is True,
                switch_supported=_flag(body.get("switch_supported")),
            )
        info = await self.server_info(worker.url)
        if _is_router(info):
            raise NotAWorker(worker.url)
        hazard = radix_switch_hazard(info)
        if detected and hazard is not None:
            logger.warning("worker %s: %s", worker.url, hazard)
        state = _live_state(info)
        return RoleReading(
            live_role(info),
            _port(info.get("disaggregation_bootstrap_port")),
            instance=_signature(state.get("startup_time", info.get("startup_time"))),
            switch_supported=_flag(info.get("enable_pd_role_switch")),
        )

    async def read_load(self, worker: Worker) -> LoadReading:
        """The worker's load (``/pd_role``, else ``/v1/loads``)."""
        if await self.detect_extensions(worker):
            body = await self._get_ok(worker.url, ROLE_PATH)
            return LoadReading(
                bool(body.get("idle")), _int(body.get("num_running")), _int(body.get("num_waiting"))
            )
        running, waiting = await self._native_load(worker.url)
        return LoadReading(running == 0 and waiting == 0, running, waiting)

    async def server_info(self, url: str) -> dict[str, Any]:
        return await self._get_ok(url, "/server_info")

    async def decode_graph_params(self, url: str) -> dict[str, Any]:
        """``decode_cuda_graph_bs`` / ``decode_cuda_graph_memory_gb`` of a decode peer, for a
        native switch to decode (SGLang captures its decode graphs to fit the peer's)."""
        state = _live_state(await self.server_info(url))
        return {
            name: state[name]
            for name in ("decode_cuda_graph_bs", "decode_cuda_graph_memory_gb")
            if state.get(name) is not None
        }

    # --- actions ----------------------------------------------------------------------------

    async def set_admission(self, worker: Worker, *, open_: bool) -> None:
        """``POST /pd_drain``: close (``open_`` false) or reopen the worker's admission."""
        status, body = await self._post(worker.url, DRAIN_PATH, {"drain": not open_}, self._timeout)
        if status != 200:
            raise ControlError(
                worker.url, DRAIN_PATH, f"HTTP {status}: {_short(body)}", status=status
            )

    async def switch(self, worker: Worker, body: dict[str, Any]) -> SwitchReply:
        """Native ``POST /pd_role_switch`` (HTTP 200 on success, 400 on any failure). Before a
        switch to decode of a worker exposed to SGLang's radix-cache crash, a warning names
        the flag that avoids it (the switch itself succeeds; the crash comes later)."""
        if body.get("new_role") == Role.DECODE.value:
            await self._warn_before_decode(worker)
        return await self._switch_call(worker, SWITCH_PATH, body)

    async def _warn_before_decode(self, worker: Worker) -> None:
        """The radix-cache warning, when ``/server_info`` says so; a reading that fails only
        skips it (the switch call that follows is what counts)."""
        try:
            hazard = radix_switch_hazard(await self.server_info(worker.url))
        except ControlError:
            return
        if hazard is not None:
            logger.warning("switching %s to decode: %s", worker.url, hazard)

    async def convert(self, worker: Worker, body: dict[str, Any]) -> SwitchReply:
        """Extension ``POST /convert_pd_role``: the worker drains itself, then switches."""
        return await self._switch_call(worker, CONVERT_PATH, body)

    async def forget_prefill_on_decodes(self, prefill: Worker, bootstrap_port: int | None) -> None:
        """``POST /pd_forget_prefill`` on every decode, at once, for ``prefill`` (which has just
        become a prefill again, its KV bootstrap server at ``bootstrap_port``). Never raises: a
        decode that cannot forget is logged, since its requests from that prefill may wait at
        bootstrap until the router's rendezvous wait gives up on them."""
        port = bootstrap_port or prefill.bootstrap_port
        decodes = [
            w
            for w in self._registry.in_role(Role.DECODE)
            if w is not prefill and w.model == prefill.model
        ]
        if port is None or not decodes:
            return
        body = {"bootstrap_host": prefill.bootstrap_host, "bootstrap_port": port}
        await asyncio.gather(*(self._forget_prefill(decode, prefill, body) for decode in decodes))

    async def forget_prefill(self, decode: Worker, prefill: Worker) -> None:
        """``POST /pd_forget_prefill`` on ``decode`` for ``prefill`` as it is now (a pair that
        missed its rendezvous). Never raises, as :meth:`forget_prefill_on_decodes`."""
        if prefill.bootstrap_port is not None:
            body = {
                "bootstrap_host": prefill.bootstrap_host,
                "bootstrap_port": prefill.bootstrap_port,
            }
            await self._forget_prefill(decode, prefill, body)

    async def _forget_prefill(self, decode: Worker, prefill: Worker, body: dict[str, Any]) -> None:
        try:
            status, reply = await self._post(decode.url, FORGET_PREFILL_PATH, body, self._timeout)
        except ControlError as exc:
            why = exc.reason
        else:
            if status == 200:
                logger.info("decode %s forgot the endpoints of prefill %s", decode.url, prefill.url)
                return
            why = (
                "no such route: SGLang without server_patch"
                if status == 404
                else f"HTTP {status}: {_short(reply)}"
            )
        logger.warning(
            "decode %s could not forget the old endpoints of prefill %s (%s): its requests from "
            "that prefill may hang at bootstrap (SGLang bug, docs/sglang-bugs.md)",
            decode.url, prefill.url, why,
        )  # fmt: skip

    async def canary_leg(
        self, worker: Worker, role: Role, body: dict[str, Any], timeout_secs: float
    ) -> tuple[int, Any]:
        """One leg of a conversion's canary request: ``POST /generate`` sent as ``role``."""
        limit = aiohttp.ClientTimeout(total=timeout_secs)
        return await self._post(worker.url, "/generate", body, limit, {ROLE_HEADER: role.value})

    async def abort_request(self, worker: Worker, rid: str) -> None:
        """``POST /abort_request`` for ``rid``; best effort (a worker that is gone has none)."""
        with contextlib.suppress(ControlError):
            await self._post(worker.url, "/abort_request", {"rid": rid}, self._timeout)

    async def _switch_call(self, worker: Worker, path: str, body: dict[str, Any]) -> SwitchReply:
        status, reply = await self._post(worker.url, path, body, self._switch_timeout)
        if not isinstance(reply, dict):
            raise ControlError(worker.url, path, f"HTTP {status}: reply is not a JSON object")
        return SwitchReply(status=status, body=reply)

    # --- HTTP -------------------------------------------------------------------------------

    async def _native_load(self, url: str) -> tuple[int, int]:
        body = await self._get_ok(url, "/v1/loads")
        loads = body.get("loads")
        ranks = loads if isinstance(loads, list) else [body]
        running = sum(_int(r.get("num_running_reqs")) for r in ranks if isinstance(r, dict))
        waiting = sum(_int(r.get("num_waiting_reqs")) for r in ranks if isinstance(r, dict))
        return running, waiting

    async def _get_ok(self, url: str, path: str) -> dict[str, Any]:
        status, body = await self._get(url, path)
        if status != 200 or not isinstance(body, dict):
            raise ControlError(url, path, f"HTTP {status}: {_short(body)}", status=status)
        return body

    async def _get(self, url: str, path: str) -> tuple[int, Any]:
        try:
            async with self._session.get(
                url + path, timeout=self._timeout, headers=self._headers
            ) as resp:
                return resp.status, _parse(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _control_error(url, path, exc) from exc

    async def _post(
        self,
        url: str,
        path: str,
        body: dict[str, Any],
        limit: aiohttp.ClientTimeout,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        try:
            async with self._session.post(
                url + path,
                data=orjson.dumps(body),
                headers={"Content-Type": "application/json", **self._headers, **(headers or {})},
                timeout=limit,
            ) as resp:
                return resp.status, _parse(await resp.read())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _control_error(url, path, exc) from exc


def radix_switch_hazard(info: dict[str, Any]) -> str | None:
    """Why switching this SGLang server to decode would crash it (``/server_info`` of plain
    SGLang 0.5.21-0.5.23 launched with its radix cache and ``--enable-pd-role-switch``), or None.
    A server with server_patch is never read this way (it has the extension)."""
    version = _version(info.get("version"))
    low, high = RADIX_SWITCH_CRASH_VERSIONS
    if version is None or not low <= version <= high:
        return None
    if (
        info.get("disable_radix_cache") is not False
        or info.get("enable_pd_role_switch") is not True
    ):
        return None
    return (
        f"SGLang {info['version']} runs a radix cache here and dies ('pool memory leak detected') "
        "after a switch to decode once it serves prompts sharing a prefix; relaunch it with "
        "--disable-radix-cache, or under server_patch (python -m server_patch.launch_server), "
        "which fixes it (docs/sglang-bugs.md)"
    )


def _version(value: Any) -> tuple[int, int, int] | None:
    parts = str(value).split(".")[:3]
    if len(parts) < 3 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def _parse(raw: bytes) -> Any:
    try:
        return orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        return raw[:200].decode("utf-8", "replace")


def _control_error(url: str, path: str, exc: BaseException) -> ControlError:
    delivered = not isinstance(exc, aiohttp.ClientConnectorError)
    return ControlError(url, path, _describe(exc), delivered=delivered)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _short(body: Any) -> str:
    text = body if isinstance(body, str) else orjson.dumps(body).decode()
    return text[:200]


def live_role(info: dict[str, Any]) -> Role | None:
    """The live role a ``/server_info`` reply names."""
    return worker_role(_live_state(info).get("disaggregation_mode"))


def _live_state(info: dict[str, Any]) -> dict[str, Any]:
    """``internal_states[0]``: the live scheduler state (the top level holds launch args)."""
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        return states[0]
    return {}


def _signature(value: Any) -> str | None:
    """A start signature as comparable text (SGLang's is a dict of startup durations)."""
    return None if value is None else orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _port(value: Any) -> int | None:
    return value if is_int(value) and value > 0 else None


def _is_router(info: dict[str, Any]) -> bool:
    """A router's ``/server_info`` groups its workers' by pool; a worker's has its own args."""
    return (
        isinstance(info.get("prefill"), list)
        and isinstance(info.get("decode"), list)
        and "disaggregation_mode" not in info
    )


def _flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _int(value: Any) -> int:
    return value if is_int(value) else 0
