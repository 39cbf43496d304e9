"""Every option of sglang-router 0.3.2's ``launch_router`` and smg 1.13's ``smg launch``, and
what pd-router does with it, so that a command line written for either peer starts pd-router
unchanged.

Each :class:`Option` parses with the peer's own arity (a switch, one value, a list, a repeated
URL with its bootstrap port) and either sets pd-router config keys (dotted, as in
configs/router.toml) or is accepted with one start-up warning saying why it does not apply.
The command line (pd_router/cli/main.py) is built from :data:`PEER_OPTIONS`, and the compatibility
table in docs/router.md is rendered from it (``python -m pd_router.cli.compat docs/router.md``).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pd_router.config import LOG_LEVELS, ConfigError
from pd_router.control.discovery.config import PROVIDERS
from pd_router.dataplane.routing.policies import POLICIES, POLICY_ALIASES

SGLANG = "sglang-router"
SMG = "smg"
BOTH = (SGLANG, SMG)
DOC_HEADING = "## Compatibility with sglang-router and smg"


def policy_names() -> tuple[str, ...]:
    """Every policy name pd-router accepts: its policies and their aliases."""
    return (*POLICIES, *POLICY_ALIASES)


def log_levels() -> tuple[str, ...]:
    return LOG_LEVELS


@dataclass(frozen=True)
class Arity:
    """How argparse reads an option: the peers' action, nargs and value type; ``choices`` is
    called when the parser is built, so policy names come from the policy registry."""

    action: str | type[argparse.Action] = "store"
    nargs: int | str | None = None
    type: Callable[[str], Any] | None = None
    choices: Callable[[], Sequence[str]] | None = None
    metavar: str | None = None

    def add_kwargs(self, name: str) -> dict[str, Any]:
        """add_argument's keywords for option ``name``: unset options stay out of the
        namespace, so only what the command line gave is mapped or warned about."""
        kwargs: dict[str, Any] = {"action": self.action, "default": argparse.SUPPRESS}
        takes_value = self.action not in ("store_true", argparse.BooleanOptionalAction)
        if takes_value and self.choices is None:
            kwargs["metavar"] = self.metavar or name.lstrip("-").upper().replace("-", "_")
        if self.nargs is not None:
            kwargs["nargs"] = self.nargs
        if self.type is not None:
            kwargs["type"] = self.type
        if self.choices is not None:
            kwargs["choices"] = self.choices()
        return kwargs


SWITCH = Arity("store_true")
ON_OFF = Arity(argparse.BooleanOptionalAction)
STR = Arity(type=str)
INT = Arity(type=int)
FLOAT = Arity(type=float)
STRS = Arity("extend", "*", str)
STRS1 = Arity("extend", "+", str)
FLOATS1 = Arity("extend", "+", float)
REPEAT = Arity("append", type=str)
URL_PORT = Arity("append", "+", metavar="URL [BOOTSTRAP_PORT]")
URL = Arity("append", 1, metavar="URL")
POLICY = Arity(type=str, choices=policy_names)
LOG_LEVEL = Arity(type=str, choices=log_levels)


@dataclass(frozen=True)
class Option:
    """One command-line option: its names, the peers that have it, how it parses, and what it
    does: set ``keys`` (to the value passed through ``convert``), or nothing, with ``why`` logged
    once at start-up when given (``note`` alone: the option asks for what pd-router always
    does)."""

    names: tuple[str, ...]
    peers: tuple[str, ...]
    arity: Arity
    keys: tuple[str, ...] = ()
    convert: Callable[[Any], Any] | None = None
    why: str | None = None
    note: str = ""
    help: str | None = None

    @property
    def dest(self) -> str:
        return "opt_" + self.names[0].lstrip("-").replace("-", "_")

    @property
    def label(self) -> str:
        """The names as written on a command line (an on/off switch with its ``--no-`` forms)."""
        names = list(self.names)
        if self.arity is ON_OFF:
            names += ["--no-" + name[2:] for name in self.names]
        return "/".join(names)

    def effect(self) -> str:
        """What pd-router does with the option, in one line (the doc table's last column)."""
        if self.keys:
            keys = ", ".join(f"`{key}`" for key in self.keys)
            return f"sets {keys}" + (f": {self.note}" if self.note else "")
        if self.why:
            return f"accepted with a warning: {self.why}"
        return f"accepted: {self.note}"

    def overrides(self, value: Any) -> dict[str, Any]:
        """The nested config dict this option's parsed ``value`` sets."""
        value = self.convert(value) if self.convert else value
        out: dict[str, Any] = {}
        for key in self.keys:
            *sections, name = key.split(".")
            table = out
            for section in sections:
                table = table.setdefault(section, {})
            table[name] = value
        return out


def option(
    names: str | tuple[str, ...], peers: tuple[str, ...] | str, arity: Arity, *keys: str,
    convert: Callable[[Any], Any] | None = None, note: str = "", help: str | None = None,
) -> Option:  # fmt: skip
    """An option that sets ``keys``."""
    return Option(as_tuple(names), as_tuple(peers), arity, keys, convert, None, note, help)


def warned(
    names: str | tuple[str, ...], peers: tuple[str, ...] | str, arity: Arity, why: str
) -> Option:
    """An option accepted with a start-up warning: ``why`` it does not apply."""
    return Option(as_tuple(names), as_tuple(peers), arity, why=why)


def same(
    names: str | tuple[str, ...], peers: tuple[str, ...] | str, arity: Arity, note: str
) -> Option:
    """An option asking for what pd-router always does: accepted silently."""
    return Option(as_tuple(names), as_tuple(peers), arity, note=note)


def as_tuple(value: str | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else value


def prefill_specs(values: list[list[str]]) -> list[dict[str, Any]]:
    """``--prefill URL [BOOTSTRAP_PORT]`` repeated: the port is a number, ``none`` or absent."""
    specs = []
    for entry in values:
        if len(entry) > 2:
            raise ConfigError("--prefill", f"takes URL [BOOTSTRAP_PORT], got {' '.join(entry)}")
        spec: dict[str, Any] = {"url": entry[0]}
        if len(entry) == 2 and entry[1].lower() != "none":
            try:
                spec["bootstrap_port"] = int(entry[1])
            except ValueError:
                raise ConfigError(
                    "--prefill", f"bootstrap port must be a number or 'none', got {entry[1]!r}"
                ) from None
        specs.append(spec)
    return specs


def decode_specs(values: list[list[str]]) -> list[dict[str, Any]]:
    return [{"url": entry[0]} for entry in values]


def regular_specs(values: list[str]) -> list[dict[str, Any]]:
    return [{"url": url} for url in values]


def ms_to_secs(value: float) -> float:
    return value / 1000.0


def attempts(retries: int) -> int:
    """The peers' ``max_retries`` counts attempts (``--disable-retries`` is "equivalent to
    retry_max_retries=1"); pd-router's ``max_attempts`` does too."""
    return max(1, retries)


def one_attempt(_: bool) -> int:
    return 1


def off(_: bool) -> bool:
    return False


def json_format(_: bool) -> str:
    return "json"


def no_limit_below_one(value: int) -> int:
    """The peers disable the limit with -1; pd-router with 0."""
    return max(0, value)


NO_TOKENIZER = "pd-router routes requests as sent and never tokenizes; the workers load the model"
NO_PARSERS = (
    "pd-router relays the workers' answers unchanged; reasoning and tool-call parsing is done by "
    "the workers (SGLang's --reasoning-parser, --tool-call-parser)"
)
NO_HISTORY = "pd-router serves no Responses or Conversations API, so it stores no history"
NO_DISCOVERY = "pd-router discovers prefill and decode workers only"
NO_EPD = "pd-router routes prefill/decode pairs; encode (EPD) disaggregation is not implemented"
NO_MESH = (
    "pd-router has no gossip mesh; its replicas share workers and conversions through etcd "
    "instead: start each with --etcd URL --cluster NAME (docs/router.md, 'Several replicas')"
)
NO_CONTROL_PLANE_USERS = (
    "pd-router guards its admin API with one bearer key (--admin-api-key); per-user keys, "
    "audit logs and JWT/OIDC are not implemented"
)
NO_TENANTS = "pd-router has no tenants: no per-tenant keys, limits, scheduling or storage"
NO_MULTIMODAL = "pd-router forwards multimodal requests unchanged and never fetches media"
NO_KV_EVENTS = (
    "tunes smg's event-driven KV-cache index; pd-router's cache_aware keeps an approximate "
    "radix tree of the prompts it routed (--cache-threshold, --max-tree-size)"
)
NO_KV_USAGE = (
    "pd-router does not read workers' KV usage for routing; cache_aware falls back to load "
    "balance by --balance-abs-threshold/--balance-rel-threshold"
)
NO_OVERLOAD = (
    "pd-router leaves no worker out for its queue or KV usage; bound the load with "
    "--max-concurrent-requests/--queue-size"
)
NO_LOAD_POLLING = (
    "pd-router reads the workers' /v1/loads only for a least_load pool, every 0.1 s while the "
    "loads move, backing off to 1 s while they hold"
)
LEAST_LOAD = (
    "tunes smg's least_load estimate of each worker's wait; pd-router's least_load picks the "
    "fewest requests (running + waiting) the worker reports plus those sent it since"
)
NO_STALL = (
    "pd-router takes a worker out on failed health probes and an open circuit (--health-*, "
    "--cb-*), not on silence"
)
NO_STICKY = "pd-router has no sticky sessions; every request is placed by its pool's policy"
NO_DP = (
    "pd-router sends each request to a worker URL; the worker's own data-parallel "
    "controller picks the rank"
)
NO_PREFILL_ADMISSION = (
    "pd-router has no per-prefill admission queue; the router-wide limit "
    "(--max-concurrent-requests, --queue-size, --queue-timeout-secs) bounds the load"
)
NO_STARTUP_POLL = (
    "the start-up wait (--worker-startup-timeout-secs) probes with the health settings"
)
NO_RL = "pd-router has no RL control plane (/v1/rl)"
NO_WASM = "pd-router loads no WebAssembly plugins"
METRICS_PORT = "metrics are served at /metrics on the router's own --host/--port"


def alias_of(policy: str) -> str:
    return (
        f"tunes the peers' {policy} policy; pd-router runs that name as another policy (the "
        "policy flag's start-up warning says which and why)"
    )


PEER_OPTIONS: Mapping[str, Option] = MappingProxyType({o.names[0]: o for o in (
    # Workers and listening address.
    option("--host", BOTH, STR, "host"),
    option("--port", BOTH, INT, "port"),
    same("--pd-disaggregation", BOTH, SWITCH, "pd-router always runs prefill/decode pairs"),
    same("--mini-lb", SGLANG, SWITCH, "pd-router takes mini_lb's place"),
    option("--prefill", BOTH, URL_PORT, "prefill", convert=prefill_specs,
           note="one `[[prefill]]` per flag; BOOTSTRAP_PORT a number, `none` or absent "
           "(then read from the worker's /server_info)"),
    option("--decode", BOTH, URL, "decode", convert=decode_specs,
           note="one `[[decode]]` per flag"),
    option("--worker-urls", BOTH, STRS, "regular", convert=regular_specs,
           note="regular (non-PD) workers: a request goes to one of them whole; beside "
           "--prefill/--decode too"),
    same("--enable-igw", BOTH, SWITCH,
         "pd-router routes by the request's `model` whenever its workers serve several"),
    warned("--upstream-http2", SMG, SWITCH, "pd-router speaks HTTP/1.1 to workers"),
    option("--upstream-pool-idle-timeout-secs", SMG, FLOAT, "legs.idle_timeout_secs"),
    warned("--health-check-port", SMG, INT,
           "/health, /liveness and /readiness are served on the router's own port"),
    # Policies.
    option("--policy", BOTH, POLICY, "prefill_policy", "decode_policy", "regular_policy",
           note="a policy alias logs once what pd-router runs instead"),
    option("--prefill-policy", BOTH, POLICY, "prefill_policy",
           note="wins over --policy; an alias logs once what pd-router runs instead"),
    option("--decode-policy", BOTH, POLICY, "decode_policy",
           note="wins over --policy; an alias logs once what pd-router runs instead"),
    warned("--encode-policy", SMG, STR, NO_EPD),
    option(("--cache-threshold", "--cache-match-threshold"), BOTH, FLOAT,
           "cache_aware.cache_threshold"),
    option(("--balance-abs-threshold", "--spill-abs-threshold"), BOTH, INT,
           "cache_aware.balance_abs_threshold"),
    option(("--balance-rel-threshold", "--spill-rel-threshold"), BOTH, FLOAT,
           "cache_aware.balance_rel_threshold"),
    option("--eviction-interval-secs", BOTH, FLOAT, "cache_aware.eviction_interval_secs"),
    option("--max-tree-size", BOTH, INT, "cache_aware.max_tree_size"),
    warned("--bucket-adjust-interval-secs", BOTH, INT, alias_of("bucket")),
    warned(("--max-idle-secs", "--sticky-key-idle-secs"), BOTH, INT, alias_of("manual")),
    warned("--assignment-mode", BOTH, STR, alias_of("manual")),
    warned("--prefix-token-count", SMG, INT, alias_of("prefix_hash")),
    warned("--prefix-hash-load-factor", SMG, FLOAT, alias_of("prefix_hash")),
    warned("--prefix-hash-balance-abs-threshold", SMG, INT, alias_of("prefix_hash")),
    warned("--least-load-kv-pressure-weight", SMG, FLOAT, LEAST_LOAD),
    warned("--least-load-default-throughput", SMG, FLOAT, LEAST_LOAD),
    warned("--least-load-mean-prefill-tokens", SMG, INT, LEAST_LOAD),
    warned("--least-load-max-waiting-requests", SMG, INT, LEAST_LOAD),
    warned("--power-of-two-load-metric", SMG, STR,
           "pd-router's power_of_two compares the requests in flight it counts itself"),
    warned("--balance-token-usage-threshold", SMG, FLOAT, NO_KV_USAGE),
    warned("--overload-token-usage-threshold", SMG, FLOAT, NO_KV_USAGE),
    warned("--worker-overload-waiting-requests", SMG, INT, NO_OVERLOAD),
    warned("--worker-overload-token-usage", SMG, FLOAT, NO_OVERLOAD),
    warned("--worker-overload-protection", SMG, SWITCH, NO_OVERLOAD),
    same("--disable-worker-overload-protection", SMG, SWITCH,
         "pd-router never leaves a worker out for its queue or KV usage"),
    warned("--worker-overload-shed", SMG, SWITCH, NO_OVERLOAD),
    warned("--kv-index", SMG, STR, NO_KV_EVENTS),
    warned("--worker-stall-secs", SMG, INT, NO_STALL),
    warned("--worker-wedge-secs", SMG, INT, NO_STALL),
    warned("--worker-stale-secs", SMG, INT, NO_STALL),
    warned("--worker-warmup-secs", SMG, INT, NO_KV_EVENTS),
    warned("--worker-warmup-share", SMG, FLOAT, NO_KV_EVENTS),
    warned("--worker-warmup-blocks", SMG, INT, NO_KV_EVENTS),
    warned("--worker-warmup-thin-ratio", SMG, FLOAT, NO_KV_EVENTS),
    warned("--worker-warmup-divert-every", SMG, INT, NO_KV_EVENTS),
    warned("--selection-policy", SMG, STR, NO_KV_EVENTS),
    warned("--selection-accounting-ttl-ms", SMG, INT, NO_KV_EVENTS),
    warned("--overlap-decay", SMG, FLOAT, NO_KV_EVENTS),
    warned("--selection-temperature", SMG, FLOAT, NO_KV_EVENTS),
    warned("--block-size", SMG, INT, NO_KV_EVENTS),
    warned("--cache-boundaries", SMG, STR, NO_KV_EVENTS),
    warned("--cache-index", SMG, STR, NO_KV_EVENTS),
    warned("--cache-ttl-secs", SMG, INT, NO_KV_EVENTS),
    warned(("--routing-key-override", "--sticky-sessions"), SMG, SWITCH, NO_STICKY),
    warned("--routing-key-headers", SMG, STRS, NO_STICKY),
    warned("--dp-aware", BOTH, SWITCH, NO_DP),
    warned("--dp-minimum-tokens-scheduler", SMG, SWITCH, NO_DP),
    warned("--load-monitor-interval", SMG, INT, NO_LOAD_POLLING),
    same("--disable-load-monitoring", SMG, SWITCH,
         "pd-router polls worker loads only for a least_load pool"),
    # Requests and their limits.
    option("--max-payload-size", BOTH, INT, "max_payload_size"),
    warned("--max-buffered-request-bytes", SMG, INT,
           "pd-router reads every request body whole, bounded by --max-payload-size"),
    option("--request-timeout-secs", BOTH, FLOAT, "request_timeout_secs"),
    option("--request-id-headers", BOTH, STRS, "request_id_headers",
           note="read in order before X-Request-Id; the id is echoed as X-Request-Id"),
    warned("--storage-context-headers", SMG, STRS, NO_HISTORY),
    option("--header-read-timeout-secs", SMG, FLOAT, "client_header_timeout_secs"),
    option("--idle-connection-timeout-secs", SMG, FLOAT, "client_keepalive_timeout_secs"),
    option("--stream-body-stall-timeout-secs", SMG, FLOAT, "client_body_timeout_secs"),
    warned("--sse-keepalive-secs", SMG, INT,
           "pd-router relays the worker's stream as it comes and adds no keep-alive frames"),
    option("--shutdown-grace-period-secs", BOTH, FLOAT, "server.shutdown_grace_secs",
           note="on SIGTERM or SIGINT: how long requests in flight, and conversions whose "
           "switch call went out, may take to finish"),
    option("--cors-allowed-origins", BOTH, STRS, "cors_allowed_origins"),
    option("--max-concurrent-requests", BOTH, INT, "admission.max_concurrent_requests",
           convert=no_limit_below_one, note="-1 (the peers' off) becomes 0 (no limit)"),
    option("--queue-size", BOTH, INT, "admission.queue_size"),
    option("--queue-timeout-secs", BOTH, FLOAT, "admission.queue_timeout_secs"),
    option("--rate-limit-tokens-per-second", BOTH, FLOAT,
           "admission.rate_limit_tokens_per_second"),
    warned("--max-background-responses", SMG, INT, NO_HISTORY),
    warned("--prefill-max-inflight-requests-per-worker", SMG, INT, NO_PREFILL_ADMISSION),
    warned("--prefill-queue-size", SMG, INT, NO_PREFILL_ADMISSION),
    warned("--prefill-queue-timeout-secs", SMG, INT, NO_PREFILL_ADMISSION),
    warned("--pd-admission-wait-secs", SMG, INT, NO_PREFILL_ADMISSION),
    warned("--priority-scheduler-enabled", SMG, SWITCH, NO_TENANTS),
    warned("--priority-scheduler-default-max-class", SMG, STR, NO_TENANTS),
    warned("--priority-scheduler-config", SMG, STR, NO_TENANTS),
    warned("--priority-scheduler-tenant-metric-top-n", SMG, INT, NO_TENANTS),
    warned("--tenant-rate-limit-enabled", SMG, SWITCH, NO_TENANTS),
    warned("--tenant-rate-limit-config", SMG, STR, NO_TENANTS),
    warned("--trust-tenant-header", SMG, SWITCH, NO_TENANTS),
    warned("--tenant-header-name", SMG, STR, NO_TENANTS),
    warned("--tenant-api-key", SMG, REPEAT, NO_TENANTS),
    # Retries, circuit breaker, health checks.
    option("--retry-max-retries", BOTH, INT, "retry.max_attempts", convert=attempts,
           note="the peers count attempts, as pd-router does (at least 1)"),
    option("--retry-initial-backoff-ms", BOTH, FLOAT, "retry.backoff_base_secs",
           convert=ms_to_secs, note="milliseconds to seconds"),
    option("--retry-max-backoff-ms", BOTH, FLOAT, "retry.backoff_max_secs",
           convert=ms_to_secs, note="milliseconds to seconds"),
    option("--retry-backoff-multiplier", BOTH, FLOAT, "retry.backoff_multiplier"),
    option("--retry-jitter-factor", BOTH, FLOAT, "retry.jitter_factor"),
    option("--disable-retries", BOTH, SWITCH, "retry.max_attempts", convert=one_attempt,
           note="one attempt per request"),
    option("--cb-failure-threshold", BOTH, INT, "circuit.failure_threshold"),
    option("--cb-success-threshold", BOTH, INT, "circuit.success_threshold"),
    option("--cb-timeout-duration-secs", BOTH, FLOAT, "circuit.cooldown_secs"),
    option("--cb-window-duration-secs", BOTH, FLOAT, "circuit.window_secs"),
    option("--disable-circuit-breaker", BOTH, SWITCH, "circuit.enabled", convert=off),
    option("--health-failure-threshold", BOTH, INT, "health.failure_threshold"),
    option("--health-success-threshold", BOTH, INT, "health.success_threshold"),
    option("--health-check-timeout-secs", BOTH, FLOAT, "health.timeout_secs"),
    option("--health-check-interval-secs", BOTH, FLOAT, "health.interval_secs"),
    option("--health-check-endpoint", BOTH, STR, "health.endpoint"),
    option("--disable-health-check", BOTH, SWITCH, "health.enabled", convert=off),
    warned(("--remove-unhealthy-workers", "--worker-auto-recovery"), SMG, ON_OFF,
           "an unhealthy worker stays registered and rejoins its pool when its probes pass"),
    option("--worker-startup-timeout-secs", BOTH, FLOAT, "health.startup_wait_secs",
           note="wait this long at start-up for every worker to answer its probe"),
    warned("--worker-startup-check-interval", BOTH, INT, NO_STARTUP_POLL),
    warned("--worker-startup-delay", SMG, INT, NO_STARTUP_POLL),
    warned("--job-queue-capacity", SMG, INT,
           "pd-router adds and removes workers inline, without a job queue"),
    warned("--job-queue-concurrency", SMG, INT,
           "pd-router adds and removes workers inline, without a job queue"),
    # Logs and metrics.
    option("--log-level", BOTH, LOG_LEVEL, "log_level"),
    option("--log-json", SMG, SWITCH, "log_format", convert=json_format,
           note="JSON lines, pd-router's default"),
    warned("--log-dir", BOTH, STR, "logs go to stderr; redirect them to a file"),
    warned("--prometheus-port", BOTH, INT, METRICS_PORT),
    warned("--prometheus-host", BOTH, STR, METRICS_PORT),
    warned("--prometheus-duration-buckets", BOTH, FLOATS1,
           "pd-router's latency histograms have fixed buckets"),
    option("--enable-trace", BOTH, SWITCH, "tracing.enabled",
           note="OpenTelemetry spans of requests, legs and conversions (the otel extra)"),
    option("--otlp-traces-endpoint", BOTH, STR, "tracing.endpoint",
           note="exported over OTLP/HTTP (a collector's port 4318), where the peers use gRPC"),
    warned("--jemalloc-prof-dir", SMG, STR, "pd-router is a Python process: no jemalloc"),
    # TLS and keys.
    option("--tls-cert-path", BOTH, STR, "tls.cert_path"),
    option("--tls-key-path", BOTH, STR, "tls.key_path"),
    option("--ca-cert-paths", BOTH, STRS, "tls.ca_cert_path",
           note="every CA file named is trusted for https:// workers"),
    option("--client-cert-path", BOTH, STR, "tls.client_cert_path"),
    option("--client-key-path", BOTH, STR, "tls.client_key_path"),
    option("--api-key", BOTH, STR, "worker_api_key",
           note="sent to workers as Authorization: Bearer, as the peers do"),
    warned("--control-plane-api-keys", BOTH, STRS, NO_CONTROL_PLANE_USERS),
    warned("--control-plane-audit-enabled", BOTH, SWITCH, NO_CONTROL_PLANE_USERS),
    warned("--jwt-issuer", BOTH, STR, NO_CONTROL_PLANE_USERS),
    warned("--jwt-audience", BOTH, STR, NO_CONTROL_PLANE_USERS),
    warned("--jwt-jwks-uri", BOTH, STR, NO_CONTROL_PLANE_USERS),
    warned("--jwt-role-mapping", BOTH, STRS, NO_CONTROL_PLANE_USERS),
    # Service discovery.
    option("--service-discovery", BOTH, SWITCH, "discovery.enabled",
           note="Kubernetes pods by label (docs/deploy.md, Kubernetes)"),
    option("--discovery-provider", SMG, Arity(type=str, choices=lambda: PROVIDERS),
           "discovery.provider", note="`kubernetes` or `file`; turns discovery on"),
    option("--discovery-file", SMG, STR, "discovery.file",
           note="the file provider's JSON manifest, read again when it changes"),
    option("--discovery-check-interval-secs", SMG, INT, "discovery.check_interval_secs",
           note="how often the manifest file is read"),
    option("--selector", BOTH, STRS1, "discovery.selector",
           note="labels every worker pod has; the worker's live role places it"),
    option("--service-discovery-port", BOTH, INT, "discovery.port",
           note="a pod's `smg.ai/worker-ports` annotation lists its own"),
    option("--service-discovery-namespace", BOTH, STR, "discovery.namespace",
           note="unset: every namespace"),
    option("--prefill-selector", BOTH, STRS1, "discovery.prefill_selector",
           note="proposes the prefill role; the live role wins and the role label follows it"),
    option("--decode-selector", BOTH, STRS1, "discovery.decode_selector",
           note="proposes the decode role; the live role wins and the role label follows it"),
    warned("--encode-selector", SMG, STRS1, NO_EPD),
    warned("--router-selector", SMG, STRS1, NO_MESH),
    warned("--kv-connector-annotation", SMG, STR, NO_DISCOVERY),
    warned("--kv-engine-id-annotation", SMG, STR, NO_DISCOVERY),
    option("--model-id-from", SMG, STR, "discovery.model_id_from",
           note="`namespace`, `label:KEY` or `annotation:KEY`: the model a discovered worker "
           "serves (routed by), shown with it"),
    warned("--model-alias", SMG, REPEAT,
           "pd-router serves the model names its workers report; it keeps no aliases"),
    # EPD, multimodal, RL, mesh.
    warned("--epd-disaggregation", SMG, SWITCH, NO_EPD),
    warned("--encode", SMG, URL_PORT, NO_EPD),
    warned("--multimodal-tensor-transport", SMG, STR, NO_MULTIMODAL),
    warned("--multimodal-shm-min-bytes", SMG, INT, NO_MULTIMODAL),
    warned("--multimodal-max-inflight-bytes", SMG, INT, NO_MULTIMODAL),
    warned("--mm-per-request-image-limit", SMG, INT, NO_MULTIMODAL),
    warned("--mm-processing", SMG, STR, NO_MULTIMODAL),
    warned("--mm-pixel-cache-mb", SMG, INT, NO_MULTIMODAL),
    warned("--mm-pixel-rdma", SMG, SWITCH, NO_MULTIMODAL),
    warned("--mm-allowed-media-domains", SMG, STR, NO_MULTIMODAL),
    warned("--mm-allow-private-media-hosts", SMG, SWITCH, NO_MULTIMODAL),
    warned("--rdma-listen-ip", SMG, STR, NO_MULTIMODAL),
    warned("--rdma-slot-ttl-s", SMG, INT, NO_MULTIMODAL),
    warned("--log-mm-timing", SMG, SWITCH, NO_MULTIMODAL),
    warned("--enable-rl", SMG, SWITCH, NO_RL),
    warned("--rl-control-timeout-secs", SMG, INT, NO_RL),
    warned("--rl-fanout-concurrency", SMG, INT, NO_RL),
    warned("--enable-mesh", SMG, SWITCH, NO_MESH),
    warned("--mesh-server-name", SMG, STR, NO_MESH),
    warned("--mesh-host", SMG, STR, NO_MESH),
    warned("--mesh-advertise-host", SMG, STR, NO_MESH),
    warned("--mesh-port", SMG, INT, NO_MESH),
    warned("--mesh-peer-urls", SMG, STRS, NO_MESH),
    warned("--mesh-tls-ca-cert", SMG, STR, NO_MESH),
    warned("--mesh-tls-cert", SMG, STR, NO_MESH),
    warned("--mesh-tls-key", SMG, STR, NO_MESH),
    # Tokenizer, parsers, backends, storage.
    warned(("--model-path", "--model"), BOTH, STR, NO_TOKENIZER),
    warned("--tokenizer-path", BOTH, STR, NO_TOKENIZER),
    same("--disable-tokenizer-autoload", SMG, SWITCH, "pd-router never loads a tokenizer"),
    warned("--chat-template", BOTH, STR,
           "pd-router forwards chat requests; the workers' --chat-template applies"),
    warned("--tokenizer-cache-enable-l0", BOTH, SWITCH, NO_TOKENIZER),
    warned("--tokenizer-cache-l0-max-entries", BOTH, INT, NO_TOKENIZER),
    warned("--tokenizer-cache-l0-max-memory", SMG, INT, NO_TOKENIZER),
    warned("--tokenizer-cache-enable-l1", BOTH, SWITCH, NO_TOKENIZER),
    warned("--tokenizer-cache-l1-max-memory", BOTH, INT, NO_TOKENIZER),
    warned("--parser", SMG, STR, NO_PARSERS),
    warned("--reasoning-parser", BOTH, STR, NO_PARSERS),
    warned("--tool-call-parser", BOTH, STR, NO_PARSERS),
    warned("--mcp-config-path", BOTH, STR, "pd-router calls no MCP tool servers"),
    warned("--backend", BOTH, STR, "pd-router routes to SGLang HTTP workers only"),
    warned("--zmq-engine-count", SMG, INT, "pd-router talks HTTP to workers, not ZMQ"),
    warned("--enable-wasm", SMG, SWITCH, NO_WASM),
    warned("--storage-hook-wasm-path", SMG, STR, NO_WASM),
    warned("--history-backend", BOTH, STR, NO_HISTORY),
    warned("--history-memory-max-responses", SMG, INT, NO_HISTORY),
    warned("--history-memory-max-items", SMG, INT, NO_HISTORY),
    warned("--history-memory-retention-secs", SMG, INT, NO_HISTORY),
    warned("--schema-config", SMG, STR, NO_HISTORY),
    warned("--oracle-wallet-path", BOTH, STR, NO_HISTORY),
    warned("--oracle-tns-alias", BOTH, STR, NO_HISTORY),
    warned("--oracle-connect-descriptor", BOTH, STR, NO_HISTORY),
    warned("--oracle-username", BOTH, STR, NO_HISTORY),
    warned("--oracle-password", BOTH, STR, NO_HISTORY),
    warned("--oracle-external-auth", SMG, SWITCH, NO_HISTORY),
    warned("--oracle-pool-min", BOTH, INT, NO_HISTORY),
    warned("--oracle-pool-max", BOTH, INT, NO_HISTORY),
    warned("--oracle-pool-timeout-secs", BOTH, INT, NO_HISTORY),
    warned("--postgres-db-url", BOTH, STR, NO_HISTORY),
    warned("--postgres-pool-max", BOTH, INT, NO_HISTORY),
    warned("--postgres-op-timeout-secs", SMG, INT, NO_HISTORY),
    warned("--redis-url", BOTH, STR, NO_HISTORY),
    warned("--redis-pool-max", BOTH, INT, NO_HISTORY),
    warned("--redis-retention-days", BOTH, INT, NO_HISTORY),
    warned("--redis-op-timeout-secs", SMG, INT, NO_HISTORY),
)})  # fmt: skip


def doc_section(options: Mapping[str, Option] = PEER_OPTIONS) -> str:
    """The compatibility section of docs/router.md, heading to table."""
    rows = [
        f"| `{o.label.replace('/', '`, `')}` | {', '.join(o.peers)} | {o.effect()} |"
        for o in options.values()
    ]
    return "\n".join(
        [
            DOC_HEADING,
            "",
            "Every option of sglang-router 0.3.2's `python -m sglang_router.launch_router` and",
            "smg 1.13's `smg launch` is accepted (`pd-router launch ...` also works), with the",
            "peer's arity: it sets the pd-router config keys named below, or is accepted with",
            "one start-up warning naming it and why it does not apply. A policy name that",
            "pd-router runs as an alias logs once what runs instead. Generated from",
            "`pd_router/cli/compat.py` (`python -m pd_router.cli.compat docs/router.md`).",
            "",
            "| option | peer(s) | what pd-router does |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def replace_doc_section(text: str, section: str) -> str:
    """``text`` (a markdown document) with its compatibility section replaced by ``section``
    (appended when absent)."""
    pattern = re.compile(rf"^{re.escape(DOC_HEADING)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: section + "\n", text, count=1)
    return text.rstrip("\n") + "\n\n" + section


def main(argv: Sequence[str]) -> int:
    """Rewrite the compatibility section of the markdown file ``argv[0]``."""
    path = Path(argv[0])
    path.write_text(replace_doc_section(path.read_text(), doc_section()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
