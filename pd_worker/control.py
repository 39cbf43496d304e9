"""The engine's role switch as SGLang's HTTP layer serves it, and the engine seen through the
extension's ``RoleBackend`` protocol (pd_protocol.extension).

On SGLang, ``POST /pd_role_switch`` goes through FastAPI's validation of
``PdRoleSwitchReqInput`` (:func:`pd_worker.validation.pd_role_switch_body`) and then
``TokenizerManager.pd_role_switch`` before it reaches the scheduler's handler (which
:meth:`~pd_worker.engine.Engine.switch_role` models); the tokenizer layer is modeled here.
"""

from __future__ import annotations

from typing import Any

from pd_protocol.extension import Load
from pd_worker.engine import NOT_DISAGGREGATED, SWITCH_REPLY_ROUTING, Engine


def switch_refusal(engine: Engine, request: dict[str, Any], message: str) -> dict[str, Any]:
    """A switch refused before anything changed, in SGLang's reply shape."""
    return {
        **SWITCH_REPLY_ROUTING,
        "success": False,
        "message": message,
        "old_role": engine.role_name,
        "new_role": request.get("new_role", ""),
        "safe_to_restore": True,
    }


async def tokenizer_switch(engine: Engine, request: dict[str, Any]) -> dict[str, Any]:
    """``TokenizerManager.pd_role_switch`` over one scheduler: the flag is checked here first,
    with the tokenizer's own message, and every success other than a ``prepare_only`` check is
    reported as ``"ok"`` (the scheduler's "already in target role" too). A regular server is
    refused first with the scheduler's message, which names the reason whatever the flag."""
    if engine.config.regular:
        return switch_refusal(engine, request, NOT_DISAGGREGATED)
    if not engine.config.enable_pd_role_switch:
        return switch_refusal(engine, request, "--enable-pd-role-switch is not set on this server")
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
        return self._engine.bootstrap_port

    def switch_supported(self) -> bool:
        config = self._engine.config
        return config.enable_pd_role_switch and not config.regular

    async def forget_prefill(self, bootstrap_host: str, bootstrap_port: int) -> None:
        """A decode here pulls every room from the prefill's bootstrap server itself, which
        outlives role switches, so it keeps nothing to drop (an SGLang decode keeps the rank
        endpoints that server named, which a prefill's round trip through decode replaces),
        except the ``stale_bootstrap`` fault, the imitation of that endpoint: it is cleared for
        this prefill, as server_patch's forget mends the real one."""
        faults = self._engine.faults
        if faults.stale_bootstrap == f"{bootstrap_host}:{bootstrap_port}":
            faults.stale_bootstrap = ""
