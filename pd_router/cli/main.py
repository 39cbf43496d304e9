"""The ``pd-router`` command: ``serve`` (the default; also ``launch``), ``demo``, ``status``,
``convert`` and ``autopilot``.

``serve`` takes every option of sglang-router's ``python -m sglang_router.launch_router`` and
of ``smg launch`` (pd_router/cli/compat.py says what each does), so their PD command lines start
pd-router unchanged:

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

from pd_protocol.listen import ListenError, check_can_listen
from pd_router.cli import help as serve_help
from pd_router.cli.compat import (
    FLOAT,
    INT,
    PEER_OPTIONS,
    REPEAT,
    STR,
    SWITCH,
    Arity,
    Option,
    option,
)
from pd_router.cli.exposure import ADMIN_KEY_ENV, Exposed, admin_exposure
from pd_router.cli.usage import INTERRUPTED, USAGE_ERROR, nearest
from pd_router.config import LOG_FORMATS, ConfigError, RouterConfig, load_config, merge
from pd_router.control.discovery.config import DiscoveryUnavailable
from pd_router.control.discovery.kubernetes import check_credentials
from pd_router.dataplane.routing import policies

SUBCOMMANDS = ("serve", "launch", "demo", "status", "convert", "autopilot")
WORKER_API_KEY_ENV = "PD_ROUTER_WORKER_API_KEY"
ADMIN_KEY_KEYS = ("admin_api_key", "admin_api_key_file")
log = logging.getLogger("pd_router.cli.main")


def process_count(text: str) -> int | str:
    """``--workers``: a number or ``auto``."""
    return text if text == "auto" else int(text)


# pd-router's own options (the peers' are in pd_router.cli.compat.PEER_OPTIONS).
NATIVE_OPTIONS: tuple[Option, ...] = (
    option("--wait-for-workers", (), FLOAT, "health.startup_wait_secs",
           help="at start-up, wait up to SECS for every worker to answer its probe"),
    option("--connect-timeout-secs", (), FLOAT, "connect_timeout_secs",
           help="TCP connect to a worker"),
    option("--first-byte-timeout-secs", (), FLOAT, "legs.first_byte_timeout_secs",
           help="per leg, until the first byte of the body (a stream's first event; a "
           "prefill's answer); not on a non-streaming decode, whose answer comes whole"),
    option("--rendezvous-timeout-secs", (), FLOAT, "legs.rendezvous_timeout_secs",
           help="per PD pair, until the prefill answers and a stream's first event: missed, "
           "both legs are aborted, the request retried on another pair, the pair kept apart"),
    option("--rendezvous-cooldown-secs", (), FLOAT, "legs.rendezvous_cooldown_secs",
           help="a pair that missed its rendezvous rests this long before one trial request"),
    option("--stream-idle-timeout-secs", (), FLOAT, "legs.stream_idle_timeout_secs",
           help="per leg, between two bytes of the body"),
    option("--max-connections-per-worker", (), INT, "legs.max_connections_per_worker",
           help="connection cap of the legs per worker"),
    option("--pool-timeout-secs", (), FLOAT, "legs.pool_timeout_secs",
           help="how long a leg waits for a connection when its worker is at the cap"),
    option("--pool-idle-timeout-secs", (), FLOAT, "legs.idle_timeout_secs",
           help="idle connections to workers are closed after this (below the workers' 5 s)"),
    option("--max-inflight-body-bytes", (), INT, "max_inflight_body_bytes",
           help="request body bytes in flight at once; more: 503 (0: no budget)"),
    option("--client-header-timeout-secs", (), FLOAT, "client_header_timeout_secs",
           help="a request's head must arrive within this long of its first byte"),
    option("--client-body-timeout-secs", (), FLOAT, "client_body_timeout_secs",
           help="longest pause between two reads of a request body (then 408)"),
    option("--client-keepalive-timeout-secs", (), FLOAT, "client_keepalive_timeout_secs",
           help="an idle client connection is closed after this long"),
    option("--max-client-connections", (), INT, "max_client_connections",
           help="open client connections at most (0: from the open file limit)"),
    option("--log-format", (), Arity(type=str, choices=lambda: LOG_FORMATS), "log_format",
           help="json: one JSON object a line, for a log collector; text: for people"),
    option("--admin-api-key-file", (), STR, "admin_api_key_file",
           help="file holding the key that guards the admin API (Authorization: Bearer); "
           f"default: ${ADMIN_KEY_ENV}"),
    option("--admin-api-key", (), STR, "admin_api_key",
           help="the admin key itself (other users see it in ps: prefer --admin-api-key-file "
           f"or ${ADMIN_KEY_ENV})"),
    option("--allow-unauthenticated", (), SWITCH, "allow_unauthenticated",
           help="serve the admin API without a key on an address other hosts can reach "
           "(refused otherwise)"),
    option("--worker-api-key", (), STR, "worker_api_key",
           help="key of workers launched with --api-key, sent as Authorization: Bearer on "
           f"every call to a worker (default: ${WORKER_API_KEY_ENV}; the peers' --api-key)"),
    option("--etcd", (), REPEAT, "cluster.etcd",
           help="etcd endpoint (repeatable) shared by the router replicas of --cluster"),
    option("--cluster", (), STR, "cluster.name",
           help="name of the cluster this replica serves with its peers on --etcd"),
    option("--replica-id", (), STR, "cluster.replica_id",
           help="this replica's name in the cluster (default: HOSTNAME-PID)"),
    option("--workers", (), Arity(type=process_count, metavar="N|auto"), "server.workers",
           help="data-plane processes sharing the port (auto: one per core); more than one "
           "adds a control process beside them"),
)  # fmt: skip


def all_options() -> tuple[Option, ...]:
    """The peers' options, then pd-router's own: a later option wins for the same key."""
    return (*PEER_OPTIONS.values(), *NATIVE_OPTIONS)


def build_parser() -> argparse.ArgumentParser:
    return serve_help.build_parser(PEER_OPTIONS.values(), NATIVE_OPTIONS)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config keys set on the command line (unset flags leave the file's values alone)."""
    given = vars(args)
    out: dict[str, Any] = {}
    for opt in all_options():
        if opt.dest in given:
            out = merge(out, opt.overrides(given[opt.dest]))
    env_key = os.environ.get(WORKER_API_KEY_ENV)
    if env_key is not None and "worker_api_key" not in out:
        out["worker_api_key"] = env_key
    return with_admin_key(out)


def with_admin_key(out: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the admin key from the environment unless the command line gave a key or a
    key file; whichever of the two is set here replaces the config file's (both: an error)."""
    given = [key for key in ADMIN_KEY_KEYS if key in out]
    env_key = os.environ.get(ADMIN_KEY_ENV)
    if not given and env_key:
        out = {**out, "admin_api_key": env_key}
        given = ["admin_api_key"]
    if len(given) == 1:
        (other,) = (key for key in ADMIN_KEY_KEYS if key not in given)
        out = {**out, other: None}
    return out


def admin_key_source(args: argparse.Namespace, config: RouterConfig) -> str:
    """Where the admin key came from, for the start-up line (never the key itself)."""
    given = vars(args)
    if config.admin_api_key_file is not None:
        return config.admin_api_key_file
    if "opt_admin_api_key" in given:
        return "--admin-api-key"
    if os.environ.get(ADMIN_KEY_ENV):
        return f"${ADMIN_KEY_ENV}"
    return "the config file's admin_api_key"


def overrides_from_argv(argv: Sequence[str]) -> dict[str, Any]:
    """The config dict a ``serve`` command line sets (ConfigError on a bad value)."""
    return overrides_from_args(build_parser().parse_args(list(argv)))


def startup_warnings(args: argparse.Namespace, config: RouterConfig) -> list[str]:
    """One line per inapplicable option given (naming it and why), then one per policy alias
    the config names, from a flag or the file (what pd-router runs instead and why)."""
    given = vars(args)
    lines = [
        f"{opt.label} is accepted for compatibility but does not apply: {opt.why}"
        for opt in all_options()
        if opt.why and opt.dest in given
    ]
    explain = getattr(policies, "alias_warning", None)
    if explain is None:
        return lines
    roles = {
        "prefill_policy": config.prefill_policy,
        "decode_policy": config.decode_policy,
        **({"regular_policy": config.regular_policy} if config.regular else {}),
    }
    for name in dict.fromkeys(roles.values()):
        why = explain(name)
        if why:
            keys = " and ".join(key for key, value in roles.items() if value == name)
            lines.append(f"{keys} {name}: {why}")
    return lines


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """A validated config from parsed ``serve`` arguments (ConfigError on a bad value)."""
    config = load_config(args.config, overrides_from_args(args))
    discovered = config.cluster.enabled or config.discovery.active_provider is not None
    pd = bool(config.prefill) and bool(config.decode)
    if not discovered and not pd and (config.prefill or config.decode or not config.regular):
        raise ConfigError(
            "prefill/decode",
            "at least one --prefill and one --decode (or [[prefill]]/[[decode]]), or regular "
            "workers (--worker-urls or [[regular]]), unless the workers come from a cluster "
            "(--etcd URL --cluster NAME) or from discovery (--service-discovery, "
            "--discovery-provider file)",
        )
    return config


def config_from_argv(argv: Sequence[str]) -> RouterConfig:
    """Parse ``serve`` arguments into a validated config (ConfigError on a bad value)."""
    return config_from_args(build_parser().parse_args(list(argv)))


def serve(argv: Sequence[str]) -> int:
    from pd_router.cli.logs import configure_logging
    from pd_router.runtime.serve import run_server

    args = build_parser().parse_args(list(argv))
    try:
        config = config_from_args(args)
        if config.discovery.active_provider == "kubernetes":
            check_credentials(config.discovery.kubeconfig)
        check_can_listen(config.host, config.port, "--port")
        exposure = admin_exposure(config, admin_key_source(args, config))
    except (ConfigError, ListenError, Exposed, DiscoveryUnavailable) as exc:
        print(f"pd-router: {exc}", file=sys.stderr)
        return USAGE_ERROR
    configure_logging(config.log_level, config.log_format)
    for line in startup_warnings(args, config):
        log.warning("%s", line)
    log.log(logging.WARNING if exposure.open else logging.INFO, "%s", exposure.line)
    run_server(config)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand; a port taken between the check and the bind is one line (exit 2),
    Ctrl-C anywhere exits 130 without a traceback."""
    try:
        return run_command(list(sys.argv[1:] if argv is None else argv))
    except ListenError as exc:
        print(f"pd-router: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return INTERRUPTED


def run_command(argv: list[str]) -> int:
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        build_parser().error(unknown_command(argv[0]))
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "serve"
    command = "serve" if command == "launch" else command
    rest = argv[1:] if argv and argv[0] in SUBCOMMANDS else argv
    if command == "demo":
        from pd_router.cli.demo import main as demo_main

        return demo_main(rest)
    if command == "status":
        from pd_router.cli.admin_client import status

        return status(rest)
    if command == "convert":
        from pd_router.cli.convert import convert

        return convert(rest)
    if command == "autopilot":
        from pd_router.cli.admin_client import autopilot

        return autopilot(rest)
    return serve(rest)


def unknown_command(word: str) -> str:
    guess = nearest(word, SUBCOMMANDS)
    if guess:
        return f"unknown command {word!r} (did you mean {guess!r}?)"
    return f"unknown command {word!r} (commands: {', '.join(SUBCOMMANDS)})"


if __name__ == "__main__":
    sys.exit(main())
