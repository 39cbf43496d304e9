"""``pd-router status`` and ``pd-router autopilot``: the admin API from the command line, as
tables (``pd-router convert`` is in :mod:`pd_router.cli.convert`).

Against a router with an admin key and no key given, both show what the router's status page
shows anyone (``GET /status``, redacted) instead of failing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import httpx

from pd_router.cli.admin_http import (
    ADMIN_KEY_ENV,
    EXIT_OK,
    AuthFailure,
    Failure,
    admin_parser,
    client,
    request_json,
)

RECENT_CONVERSIONS = 10
DEFAULT_WATCH_SECS = 2.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"
REDACTED = (
    f"Redacted view: the router has an admin key and none was given (${ADMIN_KEY_ENV} or "
    "--admin-key shows {hidden}).\n"
)


def status(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Print the pools, every worker and the recent conversions as tables; with ``--watch``,
    redraw them every few seconds until interrupted."""
    parser = admin_parser(
        "pd-router status", "Show pools, workers and recent conversions.", "[--watch [SECONDS]]"
    )
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
        with client(args) as http:
            out.write(_status_text(http))
    except Failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    return EXIT_OK


def _status_text(http: httpx.Client) -> str:
    try:
        workers = request_json(http, "GET", "/workers")
    except AuthFailure as exc:
        if exc.key_sent:
            raise
        snapshot = request_json(http, "GET", "/status")
        hidden = "worker errors, epochs and the conversions"
        return REDACTED.format(hidden=hidden) + "\n" + render_status(_worker_list(snapshot), None)
    conversions = request_json(http, "GET", f"/conversions?limit={RECENT_CONVERSIONS}")
    text = render_status(_worker_list(workers), conversions.get("conversions", []))
    return render_cluster(_cluster(http)) + text


def _cluster(http: httpx.Client) -> dict[str, Any]:
    """The router's ``/cluster`` (an older router has none: a router alone, then)."""
    try:
        return request_json(http, "GET", "/cluster")
    except Failure:
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
        with client(args, timeout=max(args.watch, 2.0)) as http:
            while True:
                try:
                    body = _status_text(http)
                except Failure as exc:
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


def autopilot(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Print the autopilot's mode, targets, pool loads and last decisions; ``--mode`` changes
    the mode first."""
    parser = admin_parser(
        "pd-router autopilot", "Show (or set the mode of) the P:D autopilot.", "[--mode MODE]"
    )
    parser.add_argument("--mode", choices=("off", "recommend", "auto"), help="set the mode")
    args = parser.parse_args(list(argv))
    try:
        with client(args) as http:
            if args.mode is not None:
                request_json(http, "PUT", "/autopilot", {"mode": args.mode})
            out.write(_autopilot_text(http))
    except Failure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    return EXIT_OK


def _autopilot_text(http: httpx.Client) -> str:
    try:
        return render_autopilot(request_json(http, "GET", "/autopilot"))
    except AuthFailure as exc:
        if exc.key_sent:
            raise
    mode = request_json(http, "GET", "/status").get("autopilot", {}).get("mode")
    hidden = "targets, pool loads and decisions"
    return f"autopilot: {mode}\n\n" + REDACTED.format(hidden=hidden)


# --- rendering ------------------------------------------------------------------------------


def render_autopilot(state: dict[str, Any]) -> str:
    """Mode and targets, then each pool's load against its target, the latest decision and the
    conversions decided (newest first), each with its reason: once, or per model when the
    router runs a pilot for each of several models (``models``)."""
    config = state.get("config", {})
    in_effect = (
        "ttft_slo_ms" if config.get("ttft_slo_ms") is not None else "prefill_queue_tokens",
        "tpot_slo_ms" if config.get("tpot_slo_ms") is not None else "decode_kv_usage",
    )
    targets = ", ".join(f"{key}={config.get(key)}" for key in in_effect)
    header = f"autopilot: {state.get('mode')}  ({targets})\n"
    models = state.get("models")
    if not isinstance(models, dict):
        return header + _render_pilot(state)
    return header + "".join(
        f"\nModel {model or '?'}\n{_render_pilot(pilot)}" for model, pilot in models.items()
    )


def _render_pilot(state: dict[str, Any]) -> str:
    """One pilot's pools, latest decision and decisions."""
    loads = state.get("loads", {})
    parts = [
        "\nPools\n",
        _table(
            ["role", "workers", "needs", "measure", "value", "target", "over_for_s"],
            [
                [
                    str(load.get("role", role)),
                    str(load.get("size", "")),
                    "-" if load.get("need") is None else f"{load['need']:.1f}",
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
    if state.get("last_judgement"):
        parts.append(f"Last judged: {state['last_judgement']}\n")
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


def render_status(workers: list[dict[str, Any]], conversions: list[dict[str, Any]] | None) -> str:
    """Pools, workers (unhealthy ones first, their state shown as UNHEALTHY whatever their
    conversion state, with the last probe error below the table) and recent conversions
    (None: hidden, as without the admin key). Serving several models, the pools are counted
    per model and each worker's model is shown; one model reads as it always did."""
    workers = sorted(workers, key=lambda worker: bool(worker.get("healthy")))
    unhealthy = [w for w in workers if not w.get("healthy")]
    models = list(dict.fromkeys(_model(w) for w in workers))
    per_model = sum(1 for model in models if model) > 1
    model_column = ["model"] if per_model else []
    parts = [
        "Pools\n",
        _pools_table(workers, models) if per_model else _pools_table(workers, None),
        "\nWorkers\n",
        _table(
            [
                "id",
                "url",
                *model_column,
                "role",
                "state",
                "epoch",
                "healthy",
                "in-flight",
                "circuit",
            ],
            [
                [
                    str(w.get("id", "")),
                    str(w.get("url", "")),
                    *([_model(w) or "?"] if per_model else []),
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
            ["id", "worker", "from", "to", "by", "status", "total_s", "message"],
            [
                [
                    str(c.get("id", "")),
                    str(c.get("worker_url", "")),
                    str(c.get("from_role", "")),
                    str(c.get("to_role", "")),
                    by(c),
                    str(c.get("status", "")),
                    _seconds(c.get("timings", {}).get("total_s")),
                    str(c.get("message", "")),
                ]
                for c in conversions
            ],
        )
        if conversions
        else "(none)\n"
        if conversions is not None
        else "(hidden without the admin key)\n",
    ]
    return "".join(parts)


def _pools_table(workers: list[dict[str, Any]], models: list[str] | None) -> str:
    """One row per pool: prefill and decode (and regular once a regular worker is listed);
    per model when ``models`` is given, each with the pools it has."""
    if models is None:
        rows = [_pool_row(workers, role) for role in _roles(workers)]
        return _table(["pool", "active", "active+healthy", "workers"], rows)
    rows = []
    for model in models:
        members = [w for w in workers if _model(w) == model]
        rows.extend([model or "?", *_pool_row(members, role)] for role in _roles(members))
    return _table(["model", "pool", "active", "active+healthy", "workers"], rows)


def _roles(workers: list[dict[str, Any]]) -> list[str]:
    """The pools ``workers`` form: prefill and decode unless every one is a regular worker
    (none listed: both, empty), regular if any is."""
    roles = {w.get("role") for w in workers}
    pd = ["prefill", "decode"] if roles - {"regular"} or not roles else []
    return pd + (["regular"] if "regular" in roles else [])


def _pool_row(workers: list[dict[str, Any]], role: str) -> list[str]:
    members = [w for w in workers if w.get("role") == role]
    active = [w for w in members if w.get("state") == "active"]
    healthy = [w for w in active if w.get("healthy")]
    return [role, str(len(active)), str(len(healthy)), str(len(members))]


def _model(worker: dict[str, Any]) -> str:
    """The model a worker serves ("" when the router has not read it yet: no model of its
    own, as on the request path)."""
    return str(worker.get("model") or "")


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


def by(record: dict[str, Any]) -> str:
    """Who started a conversion (operator, autopilot), with the replica that runs it."""
    who = str(record.get("started_by", ""))
    return f"{who} on {record['replica']}" if record.get("replica") else who


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in [header, *rows]]  # fmt: skip
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _seconds(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, int | float) else "-"


# --- replies ---------------------------------------------------------------------------------


def _worker_list(reply: dict[str, Any]) -> list[dict[str, Any]]:
    workers = reply.get("workers", [])
    return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []
