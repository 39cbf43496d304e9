"""``pd-router convert``: move a worker to the other pool through the router and follow it.

The conversion id is printed at once with the command that aborts it, then the drain is shown
as it goes (:mod:`pd_router.cli.progress`) until the conversion ends, and its record. Ctrl-C
stops following, not the conversion: on a terminal the operator is asked whether to abort it,
otherwise it is left running and the abort command is printed again.
``pd-router convert --abort ID`` aborts a conversion that is still draining.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import httpx

from pd_router.cli.admin_client import render_conversion
from pd_router.cli.admin_http import (
    DEFAULT_ROUTER_URL,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    Failure,
    admin_parser,
    client,
    request_json,
)
from pd_router.cli.progress import ProgressView, follow

ABORTED = "aborted"


def convert(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    parser = admin_parser(
        "pd-router convert",
        "Move a worker to the other pool (drain, switch, verify), showing the drain as it goes.",
        "WORKER [--to ROLE] [--drain-timeout SECS] [--no-wait] | --abort ID",
    )
    parser.add_argument(
        "worker", nargs="?", help="worker url (or id, e.g. w3) as the router knows it"
    )
    parser.add_argument("--to", choices=("prefill", "decode"), help="default: the other role")
    parser.add_argument("--drain-timeout", type=float, help="seconds to wait for the drain")
    parser.add_argument(
        "--no-wait", action="store_true", help="return at once with the conversion id"
    )
    parser.add_argument("--abort", metavar="ID", help="abort conversion ID while it drains")
    args = parser.parse_args(list(argv))
    if (args.worker is None) == (args.abort is None):
        parser.error("give the WORKER to convert, or --abort ID")
    try:
        with client(args, timeout=None) as http:
            if args.abort is not None:
                return _abort(http, args.abort, out)
            return _convert(http, args, out)
    except Failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


def _convert(http: httpx.Client, args: argparse.Namespace, out: TextIO) -> int:
    body: dict[str, Any] = {"server_url": args.worker, "wait": False}
    if args.to:
        body["new_role"] = args.to
    if args.drain_timeout is not None:
        body["drain_timeout_secs"] = args.drain_timeout
    conversion = request_json(http, "POST", "/convert_pd_role", body, ok=(202,))["id"]
    out.write(
        f"conversion {conversion} started: {args.worker} "
        f"(abort with: {abort_command(args, conversion)})\n"
    )
    out.flush()
    if args.no_wait:
        return EXIT_OK
    record = _follow(http, args, conversion, out)
    if record is None:
        return EXIT_INTERRUPTED
    out.write(render_conversion(record))
    return EXIT_OK if record.get("success") else EXIT_FAILED


def _follow(
    http: httpx.Client, args: argparse.Namespace, conversion: str, out: TextIO
) -> dict[str, Any] | None:
    """The conversion's final record, or None when left running at Ctrl-C."""
    view = ProgressView(out)
    while True:
        try:
            return follow(lambda: _record(http, conversion), view, _finished)
        except KeyboardInterrupt:
            view.end_line()
        if not _asked_to_abort(conversion, out):
            print(
                f"conversion {conversion} left running; abort it with:\n"
                f"  {abort_command(args, conversion)}",
                file=sys.stderr,
            )
            return None
        try:
            request_json(http, "DELETE", f"/conversions/{conversion}", ok=(200, 202))
        except Failure as exc:
            print(f"cannot abort: {exc}", file=sys.stderr)


def _asked_to_abort(conversion: str, out: TextIO) -> bool:
    """On a terminal, whether the operator answers yes; never elsewhere."""
    if not (sys.stdin.isatty() and out.isatty()):
        return False
    try:
        answer = input(f"Abort conversion {conversion}? [y/N] ")
    except (EOFError, KeyboardInterrupt):
        out.write("\n")
        return False
    return answer.strip().lower() in ("y", "yes")


def _abort(http: httpx.Client, conversion: str, out: TextIO) -> int:
    request_json(http, "DELETE", f"/conversions/{conversion}", ok=(200, 202))
    record = follow(lambda: _record(http, conversion), ProgressView(out), _finished)
    out.write(render_conversion(record))
    return EXIT_OK if record.get("status") == ABORTED else EXIT_FAILED


def _record(http: httpx.Client, conversion: str) -> dict[str, Any]:
    """The conversion's record with the worker's load in tokens (``worker_load``; from the
    router's ``/get_loads``, left out when it cannot be read)."""
    record = request_json(http, "GET", f"/conversions/{conversion}")
    try:
        loads = request_json(http, "GET", "/get_loads").get("workers", [])
    except Failure:
        return record
    for entry in loads:
        if isinstance(entry, dict) and entry.get("worker") == record.get("worker_url"):
            return {**record, "worker_load": entry.get("load")}
    return record


def _finished(record: dict[str, Any]) -> bool:
    return record.get("finished_at") is not None


def abort_command(args: argparse.Namespace, conversion: str) -> str:
    """The command line that aborts ``conversion`` on this router (never with the key)."""
    command = f"pd-router convert --abort {conversion}"
    if args.router != DEFAULT_ROUTER_URL:
        command += f" --router {args.router}"
    return command
