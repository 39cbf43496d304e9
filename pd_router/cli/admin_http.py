"""How ``pd-router status``, ``convert`` and ``autopilot`` reach a router: their common flags,
the HTTP client, and failures carrying the exit status every one of them uses.

The admin key comes from ``--admin-key`` or ``$PD_ROUTER_ADMIN_KEY`` and is only ever sent in
the Authorization header, never printed.
"""

from __future__ import annotations

import argparse
import os
import ssl
from typing import Any

import httpx

from pd_router.cli.usage import INTERRUPTED, USAGE_ERROR, Parser

DEFAULT_ROUTER_URL = "http://127.0.0.1:30000"
ROUTER_URL_ENV = "PD_ROUTER_URL"
ADMIN_KEY_ENV = "PD_ROUTER_ADMIN_KEY"
CA_CERT_ENV = "PD_ROUTER_CACERT"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNREACHABLE = USAGE_ERROR
EXIT_AUTH = 3
EXIT_INTERRUPTED = INTERRUPTED
EXIT_STATUS_HELP = (
    "exit status: 0 done; 1 the router refused or the conversion failed; 2 a usage error or "
    "the router unreachable; 3 the admin key missing or wrong (HTTP 401); 130 interrupted "
    "(a conversion left running)"
)


class Failure(Exception):
    """The router refused the call (``code``: the command's exit status)."""

    code = EXIT_FAILED


class Unreachable(Failure):
    code = EXIT_UNREACHABLE


class AuthFailure(Failure):
    """HTTP 401: no key where the router wants one (``key_sent`` false), or the wrong one."""

    code = EXIT_AUTH

    def __init__(self, router: str, key_sent: bool) -> None:
        if key_sent:
            message = f"wrong admin key: the router at {router} refused it"
        else:
            message = (
                f"admin key required: the router at {router} has one; set ${ADMIN_KEY_ENV} "
                "or pass --admin-key"
            )
        super().__init__(message)
        self.key_sent = key_sent


def admin_parser(prog: str, description: str, usage: str) -> Parser:
    """A subcommand's parser with the flags every admin command takes."""
    parser = Parser(
        prog=prog, short_usage=f"{prog} {usage}", description=description, epilog=EXIT_STATUS_HELP
    )
    parser.add_argument(
        "--router",
        default=os.environ.get(ROUTER_URL_ENV, DEFAULT_ROUTER_URL),
        help=f"router url (default: ${ROUTER_URL_ENV} or {DEFAULT_ROUTER_URL})",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"admin API key (default: ${ADMIN_KEY_ENV})",
    )
    parser.add_argument(
        "--cacert",
        default=os.environ.get(CA_CERT_ENV),
        help="CA file to verify an https:// router's certificate against, for a router that "
        f"serves a certificate of a private CA (default: ${CA_CERT_ENV}, else the system store)",
    )
    return parser


def client(args: argparse.Namespace, timeout: float | None = 10.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    verify: ssl.SSLContext | bool = True
    if args.cacert:
        verify = ssl.create_default_context(cafile=args.cacert)
    return httpx.Client(
        base_url=args.router.rstrip("/"), headers=headers, timeout=timeout, verify=verify
    )


def request_json(
    http: httpx.Client,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    ok: tuple[int, ...] = (200,),
) -> dict[str, Any]:
    """The router's JSON answer; Unreachable, AuthFailure or Failure (naming the call) for a
    router not reached, a 401 or another status than ``ok``."""
    try:
        response = http.request(method, path, json=body)
    except httpx.HTTPError as exc:
        raise Unreachable(unreachable(str(http.base_url), path, exc)) from exc
    if response.status_code == 401:
        raise AuthFailure(str(http.base_url), "Authorization" in http.headers)
    reply = body_of(response)
    if response.status_code not in ok:
        message = reply.get("error", {}).get("message", response.text[:200])
        raise Failure(
            f"{method} {http.base_url.join(path)}: HTTP {response.status_code}: {message}"
        )
    return reply


def unreachable(router: str, path: str, exc: httpx.HTTPError) -> str:
    """The failure of a call that got no answer, naming the url it tried."""
    return f"router not reachable at {router.rstrip('/')}{path}: {exc or type(exc).__name__}"


def body_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"error": {"message": response.text[:200]}}
    return body if isinstance(body, dict) else {"value": body}
