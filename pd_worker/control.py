"""The engine's role switch as SGLang's HTTP layer serves it, and the engine seen through the
extension's ``RoleBackend`` protocol (server_patch.extension).

On SGLang, ``POST /pd_role_switch`` goes through FastAPI's validation of
``PdRoleSwitchReqInput`` and then ``TokenizerManager.pd_role_switch`` before it reaches the
scheduler's handler (which :meth:`~pd_worker.engine.Engine.switch_role` models). Both layers
change what a caller sees, so they are modeled here.
"""

from __future__ import annotations

from typing import Any

from pd_protocol.wire import ROLES
from pd_worker.engine import Engine
from pd_worker.errors import InvalidBody
from server_patch.extension import Load

SWITCH_ROLES = (*ROLES, "")


def check_switch_body(body: Any) -> dict[str, Any]:
    """FastAPI's validation of ``PdRoleSwitchReqInput``: the field types, ``new_role`` one of
    ``"prefill"``, ``"decode"`` or ``""`` exactly (unknown fields are ignored there)."""
    if not isinstance(body, dict):
        raise InvalidBody("1 validation error: body: Input should be a valid dictionary")
    new_role = body.get("new_role", "")
    if not isinstance(new_role, str) or new_role not in SWITCH_ROLES:
        raise InvalidBody("1 validation error: new_role: Input should be 'prefill', 'decode' or ''")
    graph_bs = body.get("decode_cuda_graph_bs")
    if graph_bs is not None and not (
        isinstance(graph_bs, list) and all(_is_int(bs) for bs in graph_bs)
    ):
        raise InvalidBody(
            "1 validation error: decode_cuda_graph_bs: Input should be a valid list of integers"
        )
    memory_gb = body.get("decode_cuda_graph_memory_gb")
    if memory_gb is not None and not (_is_int(memory_gb) or isinstance(memory_gb, float)):
        raise InvalidBody(
            "1 validation error: decode_cuda_graph_memory_gb: Input should be a valid number"
        )
    if not isinstance(body.get("prepare_only", False), bool):
        raise InvalidBody("1 validation error: prepare_only: Input should be a valid boolean")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def tokenizer_switch(engine: Engine, request: dict[str, Any]) -> dict[str, Any]:
    """``TokenizerManager.pd_role_switch`` over one scheduler: the flag is checked here first,
    with the tokenizer's own message, and every success other than a ``prepare_only`` check is
    reported as ``"ok"`` (the scheduler's "already in target role" too)."""
    if not engine.config.enable_pd_role_switch:
        return {
            "success": False,
            "message": "--enable-pd-role-switch is not set on this server",
            "old_role": engine.config.role,
            "new_role": request.get("new_role", ""),
            "safe_to_restore": True,
        }
    reply = await engine.switch_role(request)
    if reply["success"] and not request.get("prepare_only"):
        reply["message"] = "ok"
    return reply


class EngineBackend:
    """Adapts :class:`~pd_worker.engine.Engine` to ``RoleBackend`` so PDExtension can drive it;
    its switch goes through the tokenizer layer, as server_patch's does on SGLang."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    async def current_role(self) -> str:
        return self._engine.role_name

    async def load(self) -> Load:
        engine = self._engine
        return Load(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting(),
            idle=engine.is_fully_idle(),
        )

    async def switch_role(self, request: dict) -> dict:
        return await tokenizer_switch(self._engine, request)

    def bootstrap_port(self) -> int | None:
        return self._engine.config.bootstrap_port

    def switch_supported(self) -> bool:
        return self._engine.config.enable_pd_role_switch
