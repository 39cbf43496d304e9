"""The last step of a conversion's verify: one real request through the converted worker in its
new role before clients are routed to it.

A switch reply and a role read back say what the worker believes; they do not show that its
rebuilt KV manager can meet a peer. SGLang 0.5.23's own switch bugs (docs/sglang-bugs.md) leave
a server that reports the right role and then crashes on its first requests, or never completes
a KV hand-off with an old partner. So the converted worker serves one tiny PD request first, as
prefill with an active decode peer or as decode with an active prefill peer: both legs answered
200, within a bound, with no abort, is a pass. A worker whose other pool is empty has no peer
to meet, and passes unchecked (the record says so).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

from pd_router.control.worker_control import ControlError, WorkerControl
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.roles import Role

PROMPT = "pd-router canary"


@dataclass(frozen=True)
class CanaryResult:
    """``failure`` is None on a pass; ``peer`` is the worker of the other role it met."""

    peer: str | None
    failure: str | None
    duration_s: float


async def run_canary(
    control: WorkerControl,
    registry: WorkerRegistry,
    worker: Worker,
    role: Role,
    bootstrap_port: int | None,
    timeout_secs: float,
) -> CanaryResult:
    """One request through ``worker`` as ``role`` and a selectable peer of the other role."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    peers = [w for w in registry.selectable(role.other) if w is not worker]
    if not peers:
        return CanaryResult(None, None, 0.0)
    peer = min(peers, key=lambda w: (w.inflight, w.url))
    prefill, decode = (worker, peer) if role is Role.PREFILL else (peer, worker)
    port = bootstrap_port if role is Role.PREFILL else prefill.bootstrap_port
    rid = f"pd-router-canary-{secrets.token_hex(6)}"
    body: dict[str, Any] = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "bootstrap_host": prefill.bootstrap_host,
        "bootstrap_port": port,
        "bootstrap_room": secrets.randbits(63),
        "rid": rid,
    }
    legs = {Role.PREFILL: prefill, Role.DECODE: decode}
    results = await asyncio.gather(
        *(control.canary_leg(w, leg_role, body, timeout_secs) for leg_role, w in legs.items()),
        return_exceptions=True,
    )
    failures = [
        f"{leg_role} leg on {w.url}: {why}"
        for (leg_role, w), result in zip(legs.items(), results, strict=True)
        if (why := _failure(result)) is not None
    ]
    if failures:
        await asyncio.gather(
            control.abort_request(prefill, rid), control.abort_request(decode, rid)
        )
    return CanaryResult(peer.url, "; ".join(failures) or None, loop.time() - started)


def _failure(result: Any) -> str | None:
    """Why one leg's outcome is not a pass (a timeout, an error status, an aborted answer)."""
    if isinstance(result, ControlError):
        return result.reason
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    status, reply = result
    if status != 200:
        return f"HTTP {status}"
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"aborted: {finish.get('message', '')}".strip()
    return None
