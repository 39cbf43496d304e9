"""Router configuration: dataclasses, a TOML file, command-line overrides, validation.

Everything is built from one nested dict (the TOML file with the command-line overrides merged
on top), so a value means the same whether it came from the file or a flag. Validation names the
offending key and what is allowed, and start-up stops there.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import ssl
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pd_protocol.json_values import is_int, is_number
from pd_router.control.autopilot.policy import MODES, AutopilotConfig
from pd_router.control.circuit import CircuitConfig
from pd_router.control.cluster.config import ClusterConfig
from pd_router.control.discovery.config import PROVIDERS, DiscoveryConfig
from pd_router.control.discovery.selectors import Selector, SelectorError
from pd_router.control.workers import normalize_url
from pd_router.dataplane.front.concurrency import AdmissionConfig
from pd_router.dataplane.legs.pool import LegLimits
from pd_router.dataplane.routing.policies import (
    POLICIES,
    POLICY_ALIASES,
    CacheAwareConfig,
    canonical_policy_name,
)
from pd_router.dataplane.routing.retry import RetryConfig
from pd_router.roles import Role
from pd_router.tls import TLSConfig, server_context, worker_context
from pd_router.tracing import TracingConfig, endpoint_problem, otel_installed

LOG_LEVELS = ("debug", "info", "warn", "warning", "error")
LOG_FORMATS = ("json", "text")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config error: {key}: {message}")
        self.key = key


@dataclass(frozen=True)
class WorkerSpec:
    url: str
    bootstrap_port: int | None = None
    # The model it serves (None: read from the worker's /server_info).
    model: str | None = None


@dataclass(frozen=True)
class HealthConfig:
    interval_secs: float = 5.0
    timeout_secs: float = 2.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    enabled: bool = True
    # >0: at start-up, wait up to this long for every configured worker to pass a probe before
    # serving, and exit 1 naming the ones that do not (the peers' --worker-startup-timeout-secs).
    startup_wait_secs: float = 0.0


@dataclass(frozen=True)
class ConversionConfig:
    min_prefill: int = 1
    min_decode: int = 1
    max_concurrent: int = 1
    drain_timeout_secs: float = 300.0
    # One real request through a converted worker before clients get it (0: none).
    canary_timeout_secs: float = 30.0


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: the router's processes. ``workers`` data planes share the port, with a
    control process beside them when there is more than one (docs/router.md, "Processes");
    ``"auto"``: one per core this process may run on."""

    workers: int | str = 1
    # On SIGINT or SIGTERM: how long requests in flight, and conversions whose switch call went
    # out, may take to finish before the router stops anyway.
    shutdown_grace_secs: float = 60.0

    @property
    def processes(self) -> int:
        """The number of data planes ``workers`` asks for."""
        if self.workers == "auto":
            return len(os.sched_getaffinity(0))
        return int(self.workers)


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 30000
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    # Regular (colocated, non-PD) workers: a request goes to one of them whole.
    regular: tuple[WorkerSpec, ...] = ()
    prefill_policy: str = "least_inflight"
    decode_policy: str = "least_inflight"
    regular_policy: str = "least_inflight"
    request_timeout_secs: float = 1800.0
    connect_timeout_secs: float = 5.0
    max_connections: int = 2048
    max_payload_size: int = 64 * 1024 * 1024
    max_inflight_body_bytes: int = 512 * 1024 * 1024
    client_header_timeout_secs: float = 10.0
    client_body_timeout_secs: float = 60.0
    client_keepalive_timeout_secs: float = 75.0
    max_client_connections: int = 0
    request_id_headers: tuple[str, ...] = ()
    worker_removal_timeout_secs: float = 300.0
    admin_api_key: str | None = field(default=None, repr=False)
    # A file holding the admin key (read at start-up; instead of admin_api_key).
    admin_api_key_file: str | None = None
    # Serve the admin API without a key on an address other hosts can reach.
    allow_unauthenticated: bool = False
    worker_api_key: str | None = field(default=None, repr=False)
    log_level: str = "info"
    log_format: str = "json"
    cors_allowed_origins: tuple[str, ...] = ()
    health: HealthConfig = field(default_factory=HealthConfig)
    circuit: CircuitConfig = field(default_factory=CircuitConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    conversion: ConversionConfig = field(default_factory=ConversionConfig)
    legs: LegLimits = field(default_factory=LegLimits)
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    def policy_of(self, role: Role) -> str:
        if role is Role.REGULAR:
            return self.regular_policy
        return self.prefill_policy if role is Role.PREFILL else self.decode_policy


# The worker lists of a configuration, one per role.
WORKER_LISTS = tuple(role.value for role in Role)

SECTIONS: Mapping[str, type] = types.MappingProxyType(
    {
        "health": HealthConfig,
        "circuit": CircuitConfig,
        "retry": RetryConfig,
        "admission": AdmissionConfig,
        "conversion": ConversionConfig,
        "legs": LegLimits,
        "autopilot": AutopilotConfig,
        "tls": TLSConfig,
        "cache_aware": CacheAwareConfig,
        "cluster": ClusterConfig,
        "discovery": DiscoveryConfig,
        "server": ServerConfig,
        "tracing": TracingConfig,
    }
)


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> RouterConfig:
    """Read ``path`` (TOML, optional), merge ``overrides`` on top and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from exc
    return build_config(merge(data, overrides or {}))


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` on top; tables merge key by key, everything else replaces."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def build_config(data: dict[str, Any]) -> RouterConfig:
    """Validate a nested dict (TOML shape) into a RouterConfig."""
    data = dict(data)
    policy = data.pop("policy", None)
    if policy is not None:
        data.setdefault("prefill_policy", policy)
        data.setdefault("decode_policy", policy)
        data.setdefault("regular_policy", policy)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in WORKER_LISTS:
            kwargs[key] = parse_workers(key, value)
        elif key in SECTIONS:
            kwargs[key] = parse_section(key, SECTIONS[key], value)
        else:
            kwargs[key] = value
    config = parse_section("", RouterConfig, kwargs, skip=(*WORKER_LISTS, *SECTIONS))
    config = with_admin_key_file(config)
    validate(config)
    return config


def with_admin_key_file(config: RouterConfig) -> RouterConfig:
    """``config`` with the key read from ``admin_api_key_file`` (its one line), if named."""
    path = config.admin_api_key_file
    if path is None:
        return config
    if config.admin_api_key is not None:
        raise ConfigError("admin_api_key_file", "set admin_api_key or admin_api_key_file, not both")
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not a text file"
        raise ConfigError("admin_api_key_file", f"cannot read {path}: {reason}") from None
    if not key:
        raise ConfigError("admin_api_key_file", f"{path} is empty")
    return dataclasses.replace(config, admin_api_key=key)


def parse_workers(key: str, value: Any) -> tuple[WorkerSpec, ...]:
    if not isinstance(value, list):
        raise ConfigError(key, "must be a list of {url, bootstrap_port?, model?} tables")
    specs = []
    for i, item in enumerate(value):
        item_key = f"{key}[{i}]"
        if isinstance(item, str):
            item = {"url": item}
        if not isinstance(item, dict):
            raise ConfigError(item_key, "must be a table with 'url' and optional 'bootstrap_port'")
        spec = parse_section(item_key, WorkerSpec, item)
        try:
            url = normalize_url(spec.url)
        except ValueError as exc:
            raise ConfigError(f"{item_key}.url", str(exc)) from exc
        if key != "prefill" and spec.bootstrap_port is not None:
            raise ConfigError(f"{item_key}.bootstrap_port", "only prefill workers have one")
        if spec.model is not None and not spec.model.strip():
            raise ConfigError(f"{item_key}.model", "must name a model")
        check_port(f"{item_key}.bootstrap_port", spec.bootstrap_port)
        specs.append(dataclasses.replace(spec, url=url))
    return tuple(specs)


def parse_section(prefix: str, cls: type, value: Any, skip: tuple[str, ...] = ()) -> Any:
    """Build dataclass ``cls`` from a dict, checking names and types of every key."""
    if not isinstance(value, dict):
        raise ConfigError(prefix or "config", "must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, item in value.items():
        full = f"{prefix}.{key}" if prefix else key
        if key not in names:
            raise ConfigError(full, f"unknown key (known: {', '.join(sorted(names))})")
        kwargs[key] = item if key in skip else coerce(full, hints[key], item)
    return cls(**kwargs)


def coerce(key: str, hint: Any, value: Any) -> Any:
    """Check ``value`` against a field type (int, float, str, bool, a tuple of strings written
    as a list, or a union of these with None)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(key, "must not be empty")
    for option in options:
        if typing.get_origin(option) is tuple and isinstance(value, list | tuple):
            return coerce_strings(key, value)
        if option is bool and isinstance(value, bool):
            return value
        if option is int and is_int(value):
            return value
        if option is float and is_number(value):
            return float(value)
        if option is str and isinstance(value, str):
            return value
    wanted = " or ".join(type_name(o) for o in options if o is not type(None))
    raise ConfigError(key, f"must be {wanted}, got {type(value).__name__} {value!r}")


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "list of strings"
    return getattr(hint, "__name__", str(hint))


def coerce_strings(key: str, value: list[Any] | tuple[Any, ...]) -> tuple[str, ...]:
    if not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"must be a list of strings, got {value!r}")
    return tuple(value)


def check_port(key: str, port: int | None) -> None:
    if port is not None and not 0 < port < 65536:
        raise ConfigError(key, f"must be a port number 1..65535, got {port}")


def check_positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(config: RouterConfig) -> None:
    """Range and choice checks that types alone do not express."""
    allowed = ", ".join([*POLICIES, *POLICY_ALIASES])
    for key in ("prefill_policy", "decode_policy", "regular_policy"):
        try:
            canonical_policy_name(getattr(config, key))
        except KeyError:
            raise ConfigError(
                key, f"unknown policy {getattr(config, key)!r} (allowed: {allowed})"
            ) from None
    check_port("port", config.port if config.port != 0 else None)
    workers = config.server.workers
    if workers != "auto" and not (isinstance(workers, int) and workers >= 1):
        raise ConfigError("server.workers", f"must be 'auto' or a number >= 1, not {workers!r}")
    check_positive("server.shutdown_grace_secs", config.server.shutdown_grace_secs, True)
    for key in ("request_timeout_secs", "connect_timeout_secs", "worker_removal_timeout_secs"):
        check_positive(key, getattr(config, key))
    for key in ("max_connections", "max_payload_size"):
        check_positive(key, getattr(config, key))
    for key in (
        "client_header_timeout_secs",
        "client_body_timeout_secs",
        "client_keepalive_timeout_secs",
    ):
        check_positive(key, getattr(config, key))
    check_positive("max_client_connections", config.max_client_connections, allow_zero=True)
    check_positive("max_inflight_body_bytes", config.max_inflight_body_bytes, allow_zero=True)
    if config.log_level.lower() not in LOG_LEVELS:
        raise ConfigError("log_level", f"must be one of {', '.join(LOG_LEVELS)}")
    if config.log_format not in LOG_FORMATS:
        raise ConfigError("log_format", f"must be one of {', '.join(LOG_FORMATS)}")
    h = config.health
    check_positive("health.interval_secs", h.interval_secs)
    check_positive("health.timeout_secs", h.timeout_secs)
    check_positive("health.failure_threshold", h.failure_threshold)
    check_positive("health.success_threshold", h.success_threshold)
    check_positive("health.startup_wait_secs", h.startup_wait_secs, allow_zero=True)
    if not h.endpoint.startswith("/"):
        raise ConfigError("health.endpoint", "must be a path starting with '/'")
    check_positive("circuit.failure_threshold", config.circuit.failure_threshold)
    check_positive("circuit.cooldown_secs", config.circuit.cooldown_secs, allow_zero=True)
    check_positive("circuit.success_threshold", config.circuit.success_threshold)
    check_positive("circuit.window_secs", config.circuit.window_secs, allow_zero=True)
    validate_retry(config.retry)
    validate_admission(config.admission)
    c = config.conversion
    check_positive("conversion.min_prefill", c.min_prefill, allow_zero=True)
    check_positive("conversion.min_decode", c.min_decode, allow_zero=True)
    check_positive("conversion.max_concurrent", c.max_concurrent)
    check_positive("conversion.drain_timeout_secs", c.drain_timeout_secs)
    check_positive("conversion.canary_timeout_secs", c.canary_timeout_secs, allow_zero=True)
    for f in dataclasses.fields(LegLimits):
        check_positive(f"legs.{f.name}", getattr(config.legs, f.name))
    validate_autopilot(config.autopilot)
    validate_cors(config.cors_allowed_origins)
    validate_tls(config.tls)
    validate_cache_aware(config.cache_aware)
    validate_cluster(config.cluster)
    validate_discovery(config.discovery)
    validate_tracing(config.tracing)
    for key in ("admin_api_key", "worker_api_key"):
        value = getattr(config, key)
        if value is not None and not (
            value.isascii() and value.isprintable() and value.split() == [value]
        ):
            raise ConfigError(key, "must be non-empty printable ASCII without spaces")
    check_header_names("request_id_headers", config.request_id_headers)
    urls = [w.url for w in (*config.prefill, *config.decode, *config.regular)]
    duplicates = sorted({u for u in urls if urls.count(u) > 1})
    if duplicates:
        raise ConfigError("prefill/decode", f"worker listed twice: {', '.join(duplicates)}")


def validate_cluster(c: ClusterConfig) -> None:
    for i, endpoint in enumerate(c.etcd):
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"cluster.etcd[{i}]", f"not an http(s) url: {endpoint!r}")
    if c.enabled and not c.name:
        raise ConfigError("cluster.name", "required with cluster.etcd (--cluster NAME)")
    if c.name and not c.enabled:
        raise ConfigError("cluster.etcd", "required with cluster.name (--cluster needs --etcd URL)")
    if "/" in c.name:
        raise ConfigError("cluster.name", f"must not contain '/': {c.name!r}")
    if not c.prefix.startswith("/"):
        raise ConfigError("cluster.prefix", f"must start with '/': {c.prefix!r}")
    check_positive("cluster.lease_ttl_secs", c.lease_ttl_secs)


def validate_tracing(t: TracingConfig) -> None:
    """An exportable endpoint and a sampling fraction; tracing on needs the otel extra, said
    at start-up rather than at the first span."""
    problem = endpoint_problem(t.endpoint)
    if problem is not None:
        raise ConfigError("tracing.endpoint", problem)
    if not 0.0 <= t.sample_ratio <= 1.0:
        raise ConfigError("tracing.sample_ratio", f"must be in [0, 1], got {t.sample_ratio}")
    if not t.service_name:
        raise ConfigError("tracing.service_name", "must not be empty")
    if t.enabled and not otel_installed():
        raise ConfigError(
            "tracing.enabled",
            "needs OpenTelemetry's SDK and OTLP exporter: pip install 'pd-router[otel]'",
        )


def validate_discovery(d: DiscoveryConfig) -> None:
    provider = d.active_provider
    if provider is not None and provider not in PROVIDERS:
        raise ConfigError("discovery.provider", f"must be one of {', '.join(PROVIDERS)}")
    if provider == "file" and not d.file:
        raise ConfigError("discovery.file", "required with the file provider (--discovery-file)")
    selectors = {}
    for key in ("selector", "prefill_selector", "decode_selector"):
        try:
            selectors[key] = Selector.parse(getattr(d, key))
        except SelectorError as exc:
            raise ConfigError(f"discovery.{key}", str(exc)) from None
    if provider == "kubernetes" and not any(selectors.values()):
        raise ConfigError(
            "discovery.selector",
            "Kubernetes discovery needs --selector or --prefill-selector/--decode-selector",
        )
    check_port("discovery.port", d.port)
    check_positive("discovery.check_interval_secs", d.check_interval_secs)
    source = d.model_id_from
    if source is not None and source != "namespace":
        kind, _, key = source.partition(":")
        if kind not in ("label", "annotation") or not key:
            raise ConfigError(
                "discovery.model_id_from",
                f"namespace, label:KEY or annotation:KEY, not {source!r}",
            )


def validate_cors(origins: tuple[str, ...]) -> None:
    """Each entry is ``*`` or an origin as browsers send it: ``scheme://host[:port]``."""
    for origin in origins:
        if origin == "*":
            continue
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
            raise ConfigError(
                "cors_allowed_origins",
                f"{origin!r} is not '*' or an origin like https://example.com[:port]",
            )


def validate_tls(tls: TLSConfig) -> None:
    """Paired keys set together, every named file present, and the files loadable (a key that
    does not match its certificate stops start-up here, naming the key)."""
    for cert, key in (("cert_path", "key_path"), ("client_cert_path", "client_key_path")):
        if (getattr(tls, cert) is None) != (getattr(tls, key) is None):
            raise ConfigError(f"tls.{key}", f"tls.{cert} and tls.{key} must be set together")
    for f in dataclasses.fields(TLSConfig):
        paths = getattr(tls, f.name)
        for path in (paths,) if isinstance(paths, str) else paths or ():
            if not Path(path).is_file():
                raise ConfigError(f"tls.{f.name}", f"no such file: {path}")
    if tls.serves_https:
        check_loads("tls.cert_path", lambda: server_context(tls))
    for ca in tls.ca_files:
        check_loads("tls.ca_cert_path", functools.partial(ssl.create_default_context, cafile=ca))
    if tls.client_cert_path is not None:
        check_loads("tls.client_cert_path", lambda: worker_context(tls))


def check_loads(key: str, load: Callable[[], object]) -> None:
    try:
        load()
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(key, f"cannot load: {exc}") from exc


def validate_retry(r: RetryConfig) -> None:
    check_positive("retry.max_attempts", r.max_attempts)
    check_positive("retry.backoff_base_secs", r.backoff_base_secs, allow_zero=True)
    check_positive("retry.backoff_max_secs", r.backoff_max_secs, allow_zero=True)
    check_positive("retry.backoff_multiplier", r.backoff_multiplier)
    if not 0 <= r.jitter_factor <= 1:
        raise ConfigError("retry.jitter_factor", f"must be in [0, 1], got {r.jitter_factor}")


def validate_admission(a: AdmissionConfig) -> None:
    check_positive("admission.max_concurrent_requests", a.max_concurrent_requests, allow_zero=True)
    check_positive("admission.queue_size", a.queue_size, allow_zero=True)
    check_positive("admission.queue_timeout_secs", a.queue_timeout_secs)
    check_positive(
        "admission.rate_limit_tokens_per_second", a.rate_limit_tokens_per_second, allow_zero=True
    )


def validate_cache_aware(c: CacheAwareConfig) -> None:
    if not 0.0 <= c.cache_threshold <= 1.0:
        raise ConfigError(
            "cache_aware.cache_threshold", f"must be in 0..1, got {c.cache_threshold}"
        )
    check_positive("cache_aware.balance_abs_threshold", c.balance_abs_threshold, allow_zero=True)
    if c.balance_rel_threshold < 1.0:
        raise ConfigError(
            "cache_aware.balance_rel_threshold", f"must be >= 1.0, got {c.balance_rel_threshold}"
        )
    check_positive("cache_aware.eviction_interval_secs", c.eviction_interval_secs, allow_zero=True)
    check_positive("cache_aware.max_tree_size", c.max_tree_size)


def build_autopilot(data: dict[str, Any]) -> AutopilotConfig:
    """An ``[autopilot]`` table (the file's, or one changed through ``PUT /autopilot``),
    checked like the file."""
    autopilot = parse_section("autopilot", AutopilotConfig, data)
    validate_autopilot(autopilot)
    return autopilot


def validate_autopilot(a: AutopilotConfig) -> None:
    if a.mode not in MODES:
        raise ConfigError("autopilot.mode", f"must be one of {', '.join(MODES)}, got {a.mode!r}")
    positive = ("interval_secs", "window_secs", "prefill_queue_tokens", "margin", "history")
    for key in positive:
        check_positive(f"autopilot.{key}", getattr(a, key))
    for key in ("sustain_secs", "cooldown_secs", "hysteresis", "flip_guard_secs", "peak_secs"):
        check_positive(f"autopilot.{key}", getattr(a, key), allow_zero=True)
    for key in ("flip_mix_change", "judge_tolerance"):
        check_positive(f"autopilot.{key}", getattr(a, key), allow_zero=True)
        if getattr(a, key) > 1:
            raise ConfigError(
                f"autopilot.{key}", f"must be a fraction in [0, 1], got {getattr(a, key)}"
            )
    for key in ("ttft_slo_ms", "tpot_slo_ms"):
        value = getattr(a, key)
        if value is not None:
            check_positive(f"autopilot.{key}", value)
    if a.window_secs < a.interval_secs:
        raise ConfigError(
            "autopilot.window_secs",
            f"must be at least interval_secs ({a.interval_secs}), got {a.window_secs}",
        )
    if not 0 < a.decode_kv_usage <= 1:
        raise ConfigError(
            "autopilot.decode_kv_usage", f"must be a fraction in (0, 1], got {a.decode_kv_usage}"
        )
    if a.margin > 1:
        raise ConfigError(
            "autopilot.margin",
            f"must be at most 1 (the donor pool must stay under its target), got {a.margin}",
        )
    if a.hysteresis >= 1:
        raise ConfigError("autopilot.hysteresis", f"must be below 1, got {a.hysteresis}")


# RFC 9110 token characters: what an HTTP field name may contain.
HEADER_NAME_CHARS = frozenset(
    "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)


def check_header_names(key: str, names: tuple[str, ...]) -> None:
    """Each must be an HTTP field name (RFC 9110 token), or no request could carry it."""
    for i, name in enumerate(names):
        if not name or not all(c in HEADER_NAME_CHARS for c in name):
            raise ConfigError(f"{key}[{i}]", f"must be an HTTP header name, got {name!r}")
