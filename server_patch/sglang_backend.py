"""`RoleBackend` over SGLang's tokenizer manager (SGLang >= 0.5.21).

The tokenizer manager is created by SGLang's `launch_server` after our patch is installed, so
the backend looks it up on every call (`tokenizer_manager()`), never at construction.

Idle here means what the native switch demands (`Scheduler.is_fully_idle()`), read from what the
tokenizer process can see without a round trip to the scheduler: the schedulers' load snapshots
(the ones `/v1/loads` serves; a scheduler publishes one at once when it becomes fully idle),
whose waiting count includes the PD bootstrap, preallocation and transfer queues, plus the
prefill inflight queue (KV still being sent); the requests the tokenizer manager still tracks;
and the generation requests admitted by our middleware that have not been answered yet. The
native switch re-checks idleness itself and refuses safely, so a stale reading costs a retry,
never a broken server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.managers.io_struct import PdRoleSwitchReqInput
from sglang.srt.utils.common import msgspec_to_builtins

from pd_protocol.extension import ExtensionError, Load, PDExtension
from server_patch.admission import InFlight
from server_patch.scheduler_hooks import FORGET_PREFILL_METHOD
from server_patch.scheduler_rpc import SchedulerRpc, SchedulerRpcError

logger = logging.getLogger(__name__)

_REPLY_FIELDS = ("success", "message", "old_role", "new_role", "safe_to_restore")


class SGLangRoleBackend:
    """Role, load and native switch of the SGLang server this process runs."""

    def __init__(
        self, tokenizer_manager: Callable[[], Any], in_flight: InFlight, rpc: SchedulerRpc
    ) -> None:
        self._tokenizer_manager = tokenizer_manager
        self._in_flight = in_flight
        self._rpc = rpc

    async def current_role(self) -> str:
        """The schedulers' live role (`internal_states`, as `/server_info` shows it); the
        tokenizer manager's own view only when the schedulers report none."""
        manager = self._tokenizer_manager()
        states = await manager.get_internal_state()
        roles = {state.get("disaggregation_mode") for state in states} - {None}
        if len(roles) > 1:
            logger.warning("DP ranks report different roles: %s", sorted(roles))
        if states and states[0].get("disaggregation_mode") is not None:
            return states[0]["disaggregation_mode"]
        return manager.disaggregation_mode.value

    async def load(self) -> Load:
        manager = self._tokenizer_manager()
        snapshots = await manager.get_loads()
        running = sum(snapshot.num_running_reqs for snapshot in snapshots)
        waiting = sum(snapshot.num_waiting_reqs for snapshot in snapshots)
        sending = sum(_kv_in_flight(snapshot) for snapshot in snapshots)
        tracked = len(manager.rid_to_state)
        idle = running == 0 and waiting == 0 and sending == 0
        idle = idle and tracked == 0 and self._in_flight.count == 0
        return Load(num_running=running, num_waiting=waiting + sending, idle=idle)

    async def switch_role(self, request: dict) -> dict:
        manager = self._tokenizer_manager()
        try:
            result = await manager.pd_role_switch(PdRoleSwitchReqInput(**request), None)
        except Exception as error:
            # The switch may have stopped half-way: report it as SGLang's scheduler reports an
            # exception during the switch (not safe to restore).
            logger.exception("pd_role_switch raised")
            return {
                "success": False,
                "message": f"role switch raised: {error}",
                "old_role": manager.disaggregation_mode.value,
                "new_role": request.get("new_role", ""),
                "safe_to_restore": False,
            }
        reply = msgspec_to_builtins(result)
        return {name: reply[name] for name in _REPLY_FIELDS}

    def bootstrap_port(self) -> int | None:
        return resolving_view(self._tokenizer_manager().server_args).disaggregation_bootstrap_port

    def switch_supported(self) -> bool:
        return bool(resolving_view(self._tokenizer_manager().server_args).enable_pd_role_switch)

    async def forget_prefill(self, bootstrap_host: str, bootstrap_port: int) -> None:
        """The scheduler's `pd_router_forget_prefill` (server_patch.scheduler_hooks), over
        SGLang's scheduler RPC; 503 when the scheduler cannot be asked or fails."""
        try:
            await self._rpc.call(
                FORGET_PREFILL_METHOD, bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port
            )
        except SchedulerRpcError as error:
            raise ExtensionError(str(error), status=503) from error


def _kv_in_flight(snapshot: Any) -> int:
    """Prefilled requests whose KV is still being sent to a decode server.

    `num_waiting_reqs` already counts the bootstrap, preallocation, transfer and retracted
    queues; only the prefill inflight queue is outside it.
    """
    section = snapshot.disaggregation
    return 0 if section is None else section.prefill_inflight_queue_reqs


def install_on_sglang_app(rpc: SchedulerRpc, *, idle_poll_interval: float = 0.05) -> PDExtension:
    """Add the extension routes and admission gate to SGLang's FastAPI `app`.

    Must run before SGLang starts serving (Starlette refuses middleware after the first request);
    the tokenizer manager is looked up through SGLang's global state at request time, the
    scheduler is reached through `rpc` once the launch recorded where.
    """
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from server_patch.fastapi_routes import install

    in_flight = InFlight()
    backend = SGLangRoleBackend(
        lambda: http_server.get_global_state().tokenizer_manager, in_flight, rpc
    )
    extension = PDExtension(backend, idle_poll_interval=idle_poll_interval)
    install(
        http_server.app,
        extension,
        in_flight,
        control_auth=auth_level(AuthLevel.ADMIN_OPTIONAL),
    )
    return extension
