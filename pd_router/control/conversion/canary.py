"""The last step of a conversion's verify: a real request through the converted worker in its new
role before clients are routed to it.

A switch reply and a role read back say what the worker believes; they do not show that its
rebuilt KV manager can meet a peer. SGLang 0.5.23's own switch bugs (docs/sglang-bugs.md) leave
a server that reports the right role and then crashes on its first requests, or never completes
a KV hand-off with an old partner. So the converted worker serves one tiny PD request with each
of up to :data:`MAX_PEERS` active workers of the other role at once, and passes as soon as one
pair answers: both legs 200, within the bound, not aborted. A pass with one peer and not another
says the other pair is at fault (a plain SGLang decode that kept the endpoints of a round-tripped
prefill cannot be told to forget them), not the worker; the router's rendezvous wait keeps
clients away from such a pair. Only a worker that meets none of its peers fails. A worker whose
other pool is empty has no peer to meet, and passes unchecked (the record says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from pd_router.control.worker_control import ControlError, WorkerControl
from pd_router.control.workers import Worker, WorkerRegistry
from pd_router.roles import Role

PROMPT = "pd-router canary"
MAX_PEERS = 3


@dataclass(frozen=True)
class CanaryResult:
    """``peer``: the worker it met (None: no peer to meet, or none met); ``failures``: why each
    peer tried before a pass, or every peer on a fail."""

    peer: str | None
    failures: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.peer is None and bool(self.failures)

    def as_dict(self) -> dict[str, Any]:
        return {"peer": self.peer, "failures": self.failures}


async def run_canary(
    control: WorkerControl,
    registry: WorkerRegistry,
    worker: Worker,
    role: Role,
    bootstrap_port: int | None,
    timeout_secs: float,
) -> CanaryResult:
    """A request through ``worker`` as ``role`` with each of its least busy selectable peers of
    the other role, all at once; the first pair that answers passes it and the rest are
    cancelled (and aborted on the workers)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    peers = sorted(
        (w for w in registry.selectable(role.other) if w is not worker),
        key=lambda w: (w.inflight, w.url),
    )[:MAX_PEERS]
    if not peers:
        return CanaryResult(None)
    tries = [
        asyncio.ensure_future(_pair(control, worker, role, peer, bootstrap_port, timeout_secs))
        for peer in peers
    ]
    failures: dict[str, str] = {}
    met: str | None = None
    try:
        for done in asyncio.as_completed(tries):
            peer_url, why = await done
            if why is None:
                met = peer_url
                break
            failures[peer_url] = why
    finally:
        for task in tries:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tries, return_exceptions=True)
    return CanaryResult(met, failures, loop.time() - started)


async def _pair(
    control: WorkerControl,
    worker: Worker,
    role: Role,
    peer: Worker,
    bootstrap_port: int | None,
    timeout_secs: float,
) -> tuple[str, str | None]:
    """One canary request through ``worker`` and ``peer``: the peer's url and why it failed
    (None when it passed). A failed or cancelled pair has its request aborted on both."""
    prefill, decode = (worker, peer) if role is Role.PREFILL else (peer, worker)
    rid = f"pd-router-canary-{secrets.token_hex(6)}"
    body: dict[str, Any] = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "bootstrap_host": prefill.bootstrap_host,
        "bootstrap_port": bootstrap_port if role is Role.PREFILL else prefill.bootstrap_port,
        "bootstrap_room": secrets.randbits(63),
        "rid": rid,
    }
    legs = {Role.PREFILL: prefill, Role.DECODE: decode}
    passed = False
    try:
        results = await asyncio.gather(
            *(control.canary_leg(w, leg_role, body, timeout_secs) for leg_role, w in legs.items()),
            return_exceptions=True,
        )
        why = [
            f"{leg_role} leg on {w.url}: {reason}"
            for (leg_role, w), result in zip(legs.items(), results, strict=True)
            if (reason := _failure(result)) is not None
        ]
        passed = not why
        return peer.url, "; ".join(why) or None
    finally:
        if not passed:
            aborts = (control.abort_request(w, rid) for w in (prefill, decode))
            await asyncio.shield(asyncio.gather(*aborts))


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
