"""``pd-router status``, ``pd-router convert`` and ``pd-router autopilot``: the admin API from
the command line.

They talk to a running router over HTTP (httpx). The admin key comes from ``--admin-key`` or the
``PD_ROUTER_ADMIN_KEY`` environment variable and is only ever sent in the Authorization header,
never printed.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import httpx

DEFAULT_ROUTER_URL = "http://127.0.0.1:30000"
ROUTER_URL_ENV = "PD_ROUTER_URL"
ADMIN_KEY_ENV = "PD_ROUTER_ADMIN_KEY"
CA_CERT_ENV = "PD_ROUTER_CACERT"
RECENT_CONVERSIONS = 10
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNREACHABLE = 2
DEFAULT_WATCH_SECS = 2.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def status(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Print the pools, every worker and the recent conversions as tables; with ``--watch``,
    redraw them every few seconds until interrupted."""
    parser = _parser("pd-router status", "Show pools, workers and recent conversions.")
    parser.add_argument(
        "--watch",
        nargs="?",
        const=DEFAULT_WATCH_SECS,
        type=_positive_seconds,
        metavar="SECONDS",
        help=f"redraw every SECONDS (default {DEFAULT_WATCH_SECS:g}) until Ctrl-C",
    )
    args = parser.parse_args(list(argv))
    if args.watch is not None:
        return _watch(args, out)
    try:
        with _client(args) as client:
            out.write(_status_text(client))
    except _Failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return EXIT_OK


def _status_text(client: httpx.Client) -> str:
    workers = _request_json(client, "GET", "/workers")
    conversions = _request_json(client, "GET", f"/conversions?limit={RECENT_CONVERSIONS}")
    text = render_status(_worker_list(workers), conversions.get("conversions", []))
    return render_cluster(_cluster(client)) + text


def _cluster(client: httpx.Client) -> dict[str, Any]:
    """The router's ``/cluster`` (an older router has none: a router alone, then)."""
    try:
        return _request_json(client, "GET", "/cluster")
    except _Failure:
        return {"enabled": False}


def render_cluster(cluster: dict[str, Any]) -> str:
    """One line for a replica: its cluster, the live replicas, the leader, etcd's state."""
    if not cluster.get("enabled"):
        return ""
    replicas = ", ".join(str(r) for r in cluster.get("replicas", [])) or "none seen"
    etcd = "reachable" if cluster.get("etcd_up") else "UNREACHABLE (conversions refused)"
    return (
        f"Cluster {cluster.get('name')}: replica {cluster.get('replica_id')} of [{replicas}], "
        f"leader {cluster.get('leader') or 'none'}, etcd {etcd}\n\n"
    )


def _watch(args: argparse.Namespace, out: TextIO) -> int:
    """Redraw the status until Ctrl-C; a router that goes away is shown, not fatal, so the
    picture comes back by itself when the router restarts."""
    clear = CLEAR_SCREEN if out.isatty() else ""
    try:
        with _client(args, timeout=max(args.watch, 2.0)) as client:
            while True:
                try:
                    body = _status_text(client)
                except _Failure as exc:
                    body = f"error: {exc}\n"
                stamp = time.strftime("%H:%M:%S")
                out.write(f"{clear}pd-router {args.router}  {stamp}  (every {args.watch:g}s)\n\n")
                out.write(body + ("" if clear else "\n"))
                out.flush()
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return EXIT_OK


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def convert(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Convert one worker through the router and print how it went."""
    parser = _parser("pd-router convert", "Move a worker to the other pool (drain, switch).")
    parser.add_argument("worker", help="worker url (or id, e.g. w3) as the router knows it")
    parser.add_argument("--to", choices=("prefill", "decode"), help="default: the other role")
    parser.add_argument("--drain-timeout", type=float, help="seconds to wait for the drain")
    parser.add_argument(
        "--no-wait", action="store_true", help="return at once with the conversion id"
    )
    args = parser.parse_args(list(argv))
    body: dict[str, Any] = {"server_url": args.worker, "wait": not args.no_wait}
    if args.to:
        body["new_role"] = args.to
    if args.drain_timeout is not None:
        body["drain_timeout_secs"] = args.drain_timeout
    try:
        with _client(args, timeout=None) as client:
            response = client.post("/convert_pd_role", json=body)
    except httpx.HTTPError as exc:
        print(f"error: {_unreachable(args.router, '/convert_pd_role', exc)}", file=sys.stderr)
        return EXIT_UNREACHABLE
    reply = _body(response)
    if response.status_code == 202:
        out.write(f"conversion {reply.get('id')} started: {reply.get('location')}\n")
        return EXIT_OK
    if "error" in reply:
        error = reply["error"]
        print(f"refused ({response.status_code}): {error.get('message')}", file=sys.stderr)
        return EXIT_FAILED
    out.write(render_conversion(reply))
    return EXIT_OK if reply.get("success") else EXIT_FAILED


def autopilot(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Print the autopilot's mode, targets, pool loads and last decisions; ``--mode`` changes
    the mode first."""
    parser = _parser("pd-router autopilot", "Show (or set the mode of) the P:D autopilot.")
    parser.add_argument("--mode", choices=("off", "recommend", "auto"), help="set the mode")
    args = parser.parse_args(list(argv))
    try:
        with _client(args) as client:
            if args.mode is not None:
                _request_json(client, "PUT", "/autopilot", {"mode": args.mode})
            out.write(render_autopilot(_request_json(client, "GET", "/autopilot")))
    except _Failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return EXIT_OK


# --- rendering ------------------------------------------------------------------------------


def render_autopilot(state: dict[str, Any]) -> str:
    """Mode and targets, each pool's load against its target, the latest decision and the
    conversions decided (newest first), each with its reason."""
    config = state.get("config", {})
    in_effect = (
        "ttft_slo_ms" if config.get("ttft_slo_ms") is not None else "prefill_queue_tokens",
        "tpot_slo_ms" if config.get("tpot_slo_ms") is not None else "decode_kv_usage",
    )
    targets = ", ".join(f"{key}={config.get(key)}" for key in in_effect)
    loads = state.get("loads", {})
    parts = [
        f"autopilot: {state.get('mode')}  ({targets})\n",
        "\nPools\n",
        _table(
            ["role", "workers", "measure", "value", "target", "over_for_s"],
            [
                [
                    str(load.get("role", role)),
                    str(load.get("size", "")),
                    str(load.get("measure", "")),
                    f"{load.get('value', 0):g} {load.get('unit', '')}".rstrip(),
                    f"{load.get('target', 0):g} {load.get('unit', '')}".rstrip(),
                    f"{load.get('over_for_secs', 0):g}",
                ]
                for role, load in loads.items()
            ],
        )
        if loads
        else "(no sample yet)\n",
    ]
    last = state.get("last_decision")
    if last:
        parts.append(f"\nLatest: {last.get('action')}: {last.get('reason')}\n")
    if state.get("last_error"):
        parts.append(f"Last error: {state['last_error']}\n")
    decisions = state.get("decisions", [])
    parts.append("\nDecisions\n")
    parts.append(
        _table(
            ["time", "action", "worker", "applied", "reason"],
            [
                [
                    time.strftime("%H:%M:%S", time.localtime(d.get("time", 0))),
                    str(d.get("action", "")),
                    str(d.get("worker", "")),
                    "yes" if d.get("applied") else "recommended",
                    str(d.get("reason", "")),
                ]
                for d in decisions
            ],
        )
        if decisions
        else "(none)\n"
    )
    return "".join(parts)


def render_status(workers: list[dict[str, Any]], conversions: list[dict[str, Any]]) -> str:
    """Pools, workers (unhealthy ones first, their state shown as UNHEALTHY whatever their
    conversion state, with the last probe error below the table) and recent conversions."""
    workers = sorted(workers, key=lambda worker: bool(worker.get("healthy")))
    unhealthy = [w for w in workers if not w.get("healthy")]
    pools = []
    for role in ("prefill", "decode"):
        members = [w for w in workers if w.get("role") == role]
        active = [w for w in members if w.get("state") == "active"]
        healthy = [w for w in active if w.get("healthy")]
        pools.append([role, str(len(active)), str(len(healthy)), str(len(members))])
    parts = [
        "Pools\n",
        _table(["pool", "active", "active+healthy", "workers"], pools),
        "\nWorkers\n",
        _table(
            ["id", "url", "role", "state", "epoch", "healthy", "in-flight", "circuit"],
            [
                [
                    str(w.get("id", "")),
                    str(w.get("url", "")),
                    str(w.get("role", "")),
                    _state(w),
                    str(w.get("epoch", "")),
                    "yes" if w.get("healthy") else "no",
                    str(w.get("inflight", "")),
                    str(w.get("circuit", "")),
                ]
                for w in workers
            ],
        ),
        "".join(
            f"  {w.get('url', '')} unhealthy: {w.get('last_error') or 'no answer yet'}\n"
            for w in unhealthy
        ),
        "\nRecent conversions\n",
        _table(
            ["id", "worker", "from", "to", "status", "total_s", "message"],
            [
                [
                    str(c.get("id", "")),
                    str(c.get("worker_url", "")),
                    str(c.get("from_role", "")),
                    str(c.get("to_role", "")),
                    str(c.get("status", "")),
                    _seconds(c.get("timings", {}).get("total_s")),
                    str(c.get("message", "")),
                ]
                for c in conversions
            ],
        )
        if conversions
        else "(none)\n",
    ]
    return "".join(parts)


def _state(worker: dict[str, Any]) -> str:
    """The state column: UNHEALTHY first for a worker failing its probes, with its state."""
    state = str(worker.get("state", ""))
    return state if worker.get("healthy") else f"UNHEALTHY ({state})"


def render_conversion(record: dict[str, Any]) -> str:
    timings = record.get("timings", {})
    lines = [
        f"conversion {record.get('id')}: {record.get('worker_url')} "
        f"{record.get('from_role')} -> {record.get('to_role')}: {record.get('status')}",
        f"  {record.get('message', '')}",
        "  "
        + "  ".join(
            f"{name}={_seconds(timings.get(name))}s"
            for name in ("drain_s", "switch_s", "verify_s", "total_s")
            if timings.get(name) is not None
        ),
    ]
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _seconds(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


# --- HTTP -----------------------------------------------------------------------------------


class _Failure(Exception):
    """The router could not be reached or refused the call."""


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
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


def _client(args: argparse.Namespace, timeout: float | None = 10.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    verify: ssl.SSLContext | bool = True
    if args.cacert:
        verify = ssl.create_default_context(cafile=args.cacert)
    return httpx.Client(
        base_url=args.router.rstrip("/"), headers=headers, timeout=timeout, verify=verify
    )


def _request_json(
    client: httpx.Client, method: str, path: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The router's JSON answer; _Failure naming the call for an unreachable router or a
    status other than 200."""
    try:
        response = client.request(method, path, json=body)
    except httpx.HTTPError as exc:
        raise _Failure(_unreachable(str(client.base_url), path, exc)) from exc
    reply = _body(response)
    if response.status_code != 200:
        message = reply.get("error", {}).get("message", response.text[:200])
        raise _Failure(
            f"{method} {client.base_url.join(path)}: HTTP {response.status_code}: {message}"
        )
    return reply


def _unreachable(router: str, path: str, exc: httpx.HTTPError) -> str:
    """The failure of a call that got no answer, naming the url it tried."""
    return f"router not reachable at {router.rstrip('/')}{path}: {exc or type(exc).__name__}"


def _body(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"error": {"message": response.text[:200]}}
    return body if isinstance(body, dict) else {"value": body}


def _worker_list(reply: dict[str, Any]) -> list[dict[str, Any]]:
    workers = reply.get("workers", [])
    return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []
