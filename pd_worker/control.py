"""The engine seen through the extension's ``RoleBackend`` protocol (server_patch.extension)."""

from __future__ import annotations

from pd_worker.engine import Engine
from server_patch.extension import Load


class EngineBackend:
    """Adapts :class:`~pd_worker.engine.Engine` to ``RoleBackend`` so PDExtension can drive it."""

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
        return await self._engine.switch_role(request)

    def bootstrap_port(self) -> int | None:
        return self._engine.config.bootstrap_port

    def switch_supported(self) -> bool:
        return self._engine.config.enable_pd_role_switch
