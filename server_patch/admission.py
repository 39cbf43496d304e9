"""The admission gate in front of a server's generation routes, as plain ASGI middleware.

While the extension drains the server, new generation requests get 503 with `Retry-After`, so a
second router cannot slip traffic in; requests already admitted run to the end. A generation
request whose `X-PD-Role` header names the other role than the server's live one gets 421 with
the live role in its body: a router that still counts the server in its old pool learns it at
once, instead of after a KV transfer timeout (a decode leg on a prefill waits for a pull that
never comes). The middleware
counts admitted requests until their response is fully sent and tells the extension on every
change, so a waiting conversion wakes as soon as the last one finishes. Health probes answer 503
once a switch failed unsafely (the server must be restarted). Written against raw ASGI, not a
framework, so it wraps SGLang's FastAPI app without depending on FastAPI's middleware classes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import orjson

from pd_protocol.extension import PDExtension
from pd_protocol.wire import MISDIRECTED_STATUS, RETRY_AFTER_SECS, ROLE_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GENERATION_PATHS = frozenset(
    {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/api/generate",
        "/api/chat",
    }
)
HEALTH_PATHS = frozenset({"/health", "/health_generate"})
ROLE_HEADER_KEY = ROLE_HEADER.lower().encode()


class InFlight:
    """Generation requests admitted and not yet answered in full (part of the idle reading)."""

    def __init__(self) -> None:
        self.count = 0


class AdmissionMiddleware:
    """ASGI middleware: the drain gate on generation routes, the failed flag on health routes."""

    def __init__(self, app: ASGIApp, *, extension: PDExtension, in_flight: InFlight) -> None:
        self._app = app
        self._extension = extension
        self._in_flight = in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        path = _route_path(scope)
        if path in HEALTH_PATHS and self._extension.failed:
            await _send_json(send, 503, _error("role switch failed; restart required", 503))
            return
        if path not in GENERATION_PATHS:
            await self._app(scope, receive, send)
            return
        # A draining server answers 503, not 421; admission is checked again after the role
        # (its first read awaits the backend), with no await between that check and the count.
        if self._extension.admits():
            misdirected = await self._extension.misdirected(_header(scope, ROLE_HEADER_KEY))
            if misdirected is not None:
                await _send_json(send, MISDIRECTED_STATUS, misdirected)
                return
        if not self._extension.admits():
            await _send_json(
                send,
                503,
                _error("server is draining for a role switch; retry on another server", 503),
                headers=[(b"retry-after", str(RETRY_AFTER_SECS).encode())],
            )
            return
        self._in_flight.count += 1
        self._extension.load_changed()
        try:
            await self._app(scope, receive, send)
        finally:
            self._in_flight.count -= 1
            self._extension.load_changed()


def _route_path(scope: Scope) -> str:
    """The path as routed, without a `root_path` prefix the server may be mounted under."""
    path: str = scope["path"]
    root = scope.get("root_path") or ""
    if root and path.startswith(root):
        return path[len(root) :] or "/"
    return path


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower case), or None."""
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _error(message: str, code: int) -> dict[str, Any]:
    """SGLang's JSON error shape."""
    return {"error": {"message": message, "type": "service_unavailable", "code": code}}


async def _send_json(
    send: Send, status: int, body: dict[str, Any], *, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    payload = orjson.dumps(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
