"""The ``pd-router`` command: ``serve`` (the default), ``demo``, ``status``, ``convert`` and
``autopilot``.

``serve`` takes the flags of ``python -m sglang_router.launch_router --pd-disaggregation`` that
make sense for this router, so an existing mini_lb command line works unchanged:

    pd-router --pd-disaggregation --prefill http://p1:30000 8998 --decode http://d1:30001 \\
        --host 0.0.0.0 --port 8000 --policy random

``--config router.toml`` supplies everything else; flags given on the command line win.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from pd_router.config import ConfigError, RouterConfig, load_config

SUBCOMMANDS = ("serve", "demo", "status", "convert", "autopilot")
WORKER_API_KEY_ENV = "PD_ROUTER_WORKER_API_KEY"
log = logging.getLogger("pd_router.cli")

# sglang-router flags with no meaning for this router: accepted so that an existing mini_lb
# command line starts unchanged, and named in a start-up warning. (flag, type, why)
IGNORED_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--worker-startup-timeout-secs", int, "start-up never waits for workers; an unreachable "
     "one joins its pool once its health probes pass"),
    ("--worker-startup-check-interval", int, "see --health-check-interval-secs"),
    ("--prometheus-host", str, "metrics are served at /metrics on --host/--port"),
    ("--prometheus-port", int, "metrics are served at /metrics on --host/--port"),
    ("--log-dir", str, "logs go to stderr"),
)  # fmt: skip
POLICY_CHOICES = ("random", "round_robin", "least_inflight", "power_of_two", "cache_aware")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-router",
        description="Router for SGLang prefill/decode disaggregation "
        "(subcommands: serve [default], demo, status, convert, autopilot).",
    )
    p.add_argument("--config", help="TOML config file (see configs/router.toml)")
    p.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="port to listen on (default 30000)")
    p.add_argument(
        "--prefill", nargs="+", action="append", metavar="URL [BOOTSTRAP_PORT]",
        help="prefill server URL and optional bootstrap port (a number or 'none'; without it "
        "the port is read from the server's /server_info); repeat for each prefill",
    )  # fmt: skip
    p.add_argument(
        "--decode", nargs=1, action="append", metavar="URL",
        help="decode server URL; repeat for each decode",
    )  # fmt: skip
    p.add_argument("--pd-disaggregation", action="store_true", help="accepted; always on")
    p.add_argument("--mini-lb", action="store_true", help="accepted for compatibility; ignored")
    p.add_argument("--policy", choices=POLICY_CHOICES, help="policy for both pools")
    p.add_argument("--prefill-policy", choices=POLICY_CHOICES)
    p.add_argument("--decode-policy", choices=POLICY_CHOICES)
    p.add_argument("--request-timeout-secs", type=float, help="whole request, per leg")
    p.add_argument("--connect-timeout-secs", type=float, help="TCP connect to a worker")
    p.add_argument(
        "--first-byte-timeout-secs", type=float,
        help="per leg, until the first byte of the body (a stream's first event; a prefill's "
        "answer); not on a non-streaming decode, whose answer comes whole at the end",
    )  # fmt: skip
    p.add_argument(
        "--stream-idle-timeout-secs", type=float, help="per leg, between two bytes of the body"
    )
    p.add_argument(
        "--max-connections-per-worker", type=int, help="connection cap of the legs per worker"
    )
    p.add_argument(
        "--pool-timeout-secs", type=float,
        help="how long a leg waits for a connection when its worker is at the cap",
    )  # fmt: skip
    p.add_argument(
        "--pool-idle-timeout-secs", type=float,
        help="idle connections to workers are closed after this (below the workers' 5 s)",
    )  # fmt: skip
    p.add_argument("--max-payload-size", type=int, help="largest request body in bytes")
    p.add_argument(
        "--max-inflight-body-bytes", type=int,
        help="request body bytes in flight at once; more: 503 (0: no budget)",
    )  # fmt: skip
    p.add_argument(
        "--client-header-timeout-secs", type=float,
        help="a request's head must arrive within this long of its first byte",
    )  # fmt: skip
    p.add_argument(
        "--client-body-timeout-secs", type=float,
        help="longest pause between two reads of a request body (then 408)",
    )  # fmt: skip
    p.add_argument(
        "--client-keepalive-timeout-secs", type=float,
        help="an idle client connection is closed after this long",
    )  # fmt: skip
    p.add_argument(
        "--max-client-connections", type=int,
        help="open client connections at most (0: from the open file limit)",
    )  # fmt: skip
    p.add_argument("--log-level", choices=("debug", "info", "warn", "warning", "error"))
    p.add_argument("--log-format", choices=("json", "text"))
    p.add_argument("--admin-api-key", help="key guarding the admin API (Authorization: Bearer)")
    p.add_argument(
        "--worker-api-key", "--api-key", dest="worker_api_key",
        default=os.environ.get(WORKER_API_KEY_ENV),
        help="key of workers launched with --api-key, sent as Authorization: Bearer on every "
        f"call to a worker (default: ${WORKER_API_KEY_ENV}; sglang_router's --api-key)",
    )  # fmt: skip
    p.add_argument("--health-check-interval-secs", type=float)
    p.add_argument("--health-check-timeout-secs", type=float)
    p.add_argument("--health-failure-threshold", type=int)
    p.add_argument("--health-success-threshold", type=int)
    p.add_argument("--health-check-endpoint")
    p.add_argument("--cb-failure-threshold", type=int)
    p.add_argument("--cb-timeout-duration-secs", type=float)
    p.add_argument("--retry-max-retries", type=int, help="retries after the first attempt")
    p.add_argument("--retry-initial-backoff-ms", type=float)
    p.add_argument("--retry-max-backoff-ms", type=float)
    p.add_argument("--disable-retries", action="store_true", help="one attempt per request")
    for flag, kind, why in IGNORED_FLAGS:
        p.add_argument(flag, type=kind, help=f"accepted for compatibility, ignored: {why}")
    return p


def ignored_flags(argv: Sequence[str]) -> list[str]:
    """The IGNORED_FLAGS given in ``argv``."""
    args = build_parser().parse_args(list(argv))
    return [
        flag
        for flag, _, _ in IGNORED_FLAGS
        if getattr(args, flag[2:].replace("-", "_")) is not None
    ]


def parse_prefill(values: list[str]) -> dict[str, Any]:
    if len(values) > 2:
        raise ConfigError("--prefill", f"takes URL [BOOTSTRAP_PORT], got {' '.join(values)}")
    spec: dict[str, Any] = {"url": values[0]}
    if len(values) == 2 and values[1].lower() != "none":
        try:
            spec["bootstrap_port"] = int(values[1])
        except ValueError:
            raise ConfigError(
                "--prefill", f"bootstrap port must be a number or 'none', got {values[1]!r}"
            ) from None
    return spec


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set on the command line (unset flags leave the file's values alone)."""
    out: dict[str, Any] = {}
    if args.prefill:
        out["prefill"] = [parse_prefill(v) for v in args.prefill]
    if args.decode:
        out["decode"] = [{"url": v[0]} for v in args.decode]
    if args.policy:
        out["prefill_policy"] = out["decode_policy"] = args.policy
    flat = {
        "host": args.host,
        "port": args.port,
        "prefill_policy": args.prefill_policy,
        "decode_policy": args.decode_policy,
        "request_timeout_secs": args.request_timeout_secs,
        "connect_timeout_secs": args.connect_timeout_secs,
        "max_payload_size": args.max_payload_size,
        "max_inflight_body_bytes": args.max_inflight_body_bytes,
        "client_header_timeout_secs": args.client_header_timeout_secs,
        "client_body_timeout_secs": args.client_body_timeout_secs,
        "client_keepalive_timeout_secs": args.client_keepalive_timeout_secs,
        "max_client_connections": args.max_client_connections,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "admin_api_key": args.admin_api_key,
        "worker_api_key": args.worker_api_key,
    }
    out.update({k: v for k, v in flat.items() if v is not None})
    sections = {
        "health": {
            "interval_secs": args.health_check_interval_secs,
            "timeout_secs": args.health_check_timeout_secs,
            "failure_threshold": args.health_failure_threshold,
            "success_threshold": args.health_success_threshold,
            "endpoint": args.health_check_endpoint,
        },
        "circuit": {
            "failure_threshold": args.cb_failure_threshold,
            "cooldown_secs": args.cb_timeout_duration_secs,
        },
        "retry": {
            "max_attempts": 1
            if args.disable_retries
            else (None if args.retry_max_retries is None else args.retry_max_retries + 1),
            "backoff_base_secs": ms_to_secs(args.retry_initial_backoff_ms),
            "backoff_max_secs": ms_to_secs(args.retry_max_backoff_ms),
        },
        "legs": {
            "first_byte_timeout_secs": args.first_byte_timeout_secs,
            "stream_idle_timeout_secs": args.stream_idle_timeout_secs,
            "max_connections_per_worker": args.max_connections_per_worker,
            "pool_timeout_secs": args.pool_timeout_secs,
            "idle_timeout_secs": args.pool_idle_timeout_secs,
        },
    }
    for name, values in sections.items():
        given = {k: v for k, v in values.items() if v is not None}
        if given:
            out[name] = given
    return out


def ms_to_secs(value: float | None) -> float | None:
    return None if value is None else value / 1000.0


def config_from_argv(argv: Sequence[str]) -> RouterConfig:
    """Parse ``serve`` arguments into a validated config (ConfigError on a bad value)."""
    args = build_parser().parse_args(list(argv))
    config = load_config(args.config, overrides_from_args(args))
    if not config.prefill or not config.decode:
        raise ConfigError(
            "prefill/decode", "at least one --prefill and one --decode (or [[prefill]]/[[decode]])"
        )
    return config


def serve(argv: Sequence[str]) -> int:
    from pd_router.logs import configure_logging
    from pd_router.server import run_server

    try:
        config = config_from_argv(argv)
    except ConfigError as exc:
        print(f"pd-router: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    for flag in ignored_flags(argv):
        log.warning("%s is accepted for compatibility and ignored", flag)
    run_server(config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "serve"
    rest = argv[1:] if argv and argv[0] in SUBCOMMANDS else argv
    if command == "demo":
        from pd_router.demo import main as demo_main

        return demo_main(rest)
    if command == "status":
        from pd_router.admin_client import status

        return status(rest)
    if command == "convert":
        from pd_router.admin_client import convert

        return convert(rest)
    if command == "autopilot":
        from pd_router.admin_client import autopilot

        return autopilot(rest)
    return serve(rest)


if __name__ == "__main__":
    sys.exit(main())
