"""The admin API key: which requests need it and how a request proves it has it.

Most admin routes are known by their path (the middleware in ``server.py`` checks those before
the handler runs); a few are admin calls only for some bodies (``/abort_request`` with
``abort_all``), and their handlers call :func:`require_admin` once they have read the body.
With no key configured, every check passes: the operator chose an open router.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from pd_router.api.keys import CONFIG
from pd_router.errors import Unauthorized

ADMIN_PREFIXES = (
    "/workers",
    "/convert_pd_role",
    "/pd_role_switch",
    "/conversions",
    "/autopilot",
    "/cluster",
)
ADMIN_PATHS = frozenset({"/flush_cache", "/get_loads"})


def is_admin_path(path: str) -> bool:
    return path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES)


def supplied_key(request: web.Request) -> str:
    """The key a request carries: ``Authorization: Bearer <key>`` or ``X-API-Key``."""
    supplied = request.headers.get("Authorization", "")
    if supplied[:7].lower() == "bearer ":
        return supplied[7:]
    return request.headers.get("X-API-Key", "")


def has_admin_key(request: web.Request) -> bool:
    """Whether the request may use the admin API (always, when no key is configured)."""
    key = request.app[CONFIG].admin_api_key
    return key is None or hmac.compare_digest(supplied_key(request).encode(), key.encode())


def require_admin(request: web.Request) -> None:
    """Unauthorized unless the request carries the admin key (when one is configured); the
    message tells a missing key from a wrong one."""
    if not has_admin_key(request):
        message = (
            "wrong admin API key"
            if supplied_key(request)
            else "admin API key required (Authorization: Bearer <key>)"
        )
        raise Unauthorized(message, headers={"WWW-Authenticate": "Bearer"})
