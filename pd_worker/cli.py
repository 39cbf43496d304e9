"""``pd-worker`` command line: ``serve`` one worker, or start a whole ``cluster`` of processes.

    pd-worker serve --role prefill|decode|null --port 30001 [--bootstrap-port 8998]
                    [--enable-pd-role-switch] [--model-path P] [--served-model-name NAME]
                    [--engine timing|torch [--kv-transfer mooncake|tcp] [--model-config PATH]]
                    [--profile h100-8b] [--speed 0.1] [--prefill-secs-per-token ...] [other knobs]
                    [--etcd URL [--etcd URL ...] --cluster NAME [--cluster-prefix P]
                     [--advertise-url URL] [--etcd-lease-ttl SECS]]
    pd-worker cluster --prefill 2 --decode 2 [--base-port N] [--speed 1.0] [--profile NAME]
                      [--engine timing|torch] [--kv-transfer mooncake|tcp]

Bad arguments print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import warnings
from dataclasses import fields
from importlib.metadata import version
from typing import NoReturn

from pd_protocol.cluster import DEFAULT_LEASE_TTL_SECS, DEFAULT_PREFIX
from pd_protocol.listen import ListenError, check_can_listen
from pd_protocol.registration import FlagNames, RegistrationSettings
from pd_worker.config import DEFAULT_BOOTSTRAP_PORT, DEFAULT_PORT, ENGINES, MODES, WorkerConfig
from pd_worker.data_plane import PlaneUnavailable
from pd_worker.kv_transfer import TRANSPORTS
from pd_worker.timing import PROFILES, TimingModel, profile

REGISTRATION_FLAGS = FlagNames("--etcd", "--cluster", "--advertise-url")

USAGE_ERROR = 2
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The torch engine's default KV pool: every slot is a real tensor row, so far fewer than the
# timing model's modeled capacity.
TORCH_KV_SLOTS = 4096


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error on one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _add_timing_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="named timing model calibrated to a real GPU; the knobs below override it",
    )
    defaults = TimingModel()
    for f in fields(TimingModel):
        kind = int if isinstance(getattr(defaults, f.name), int) else float
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=None,
            help=f"timing model knob (default {getattr(defaults, f.name)})",
        )


def _add_registration_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "self-registration",
        "put this worker's record in etcd under a lease (docs/self-registration.md)",
    )
    group.add_argument(
        "--etcd",
        action="append",
        default=[],
        metavar="URL",
        help="etcd client url (repeat for several; the first that answers is used)",
    )
    group.add_argument("--cluster", default=None, metavar="NAME", help="the router cluster name")
    group.add_argument(
        "--cluster-prefix",
        default=DEFAULT_PREFIX,
        metavar="P",
        help=f"etcd key prefix (default {DEFAULT_PREFIX})",
    )
    group.add_argument(
        "--advertise-url", default=None, metavar="URL",
        help="the url routers reach this worker at (default http://<host>:<port>)",
    )  # fmt: skip
    group.add_argument(
        "--etcd-lease-ttl", type=int, default=DEFAULT_LEASE_TTL_SECS, metavar="SECS",
        help="a killed worker's record goes within this many seconds",
    )  # fmt: skip


def _registration(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> RegistrationSettings | None:
    """The self-registration settings, or None without --etcd; usage errors exit 2."""
    try:
        return RegistrationSettings.from_flags(
            REGISTRATION_FLAGS, args.etcd, args.cluster, args.cluster_prefix,
            args.advertise_url, args.etcd_lease_ttl,
        )  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pd-worker", description="Reference SGLang PD worker (no GPU).")
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version('pd-router')}",
        help="print the version and exit",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = sub.add_parser("serve", help="run one worker")
    serve.add_argument(
        "--role", "--disaggregation-mode", dest="role", choices=MODES, default="prefill",
        help="prefill or decode (a PD worker), or null: a regular server that prefills and "
        "decodes alone, with no bootstrap server and no role switch (default prefill)",
    )  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--port", type=int, default=DEFAULT_PORT,
        help=f"HTTP port (default {DEFAULT_PORT}; pd-router defaults to 30000)",
    )  # fmt: skip
    serve.add_argument(
        "--bootstrap-port", "--disaggregation-bootstrap-port", dest="bootstrap_port", type=int,
        default=None,
        help=f"KV bootstrap port (default: {DEFAULT_BOOTSTRAP_PORT} for a prefill, or a free "
        "port when another process holds it; a free port for a decode; unused with null)",
    )  # fmt: skip
    serve.add_argument("--enable-pd-role-switch", action="store_true")
    serve.add_argument("--enable-faults", action="store_true", help="serve POST /fault (tests)")
    serve.add_argument("--admin-api-key", default=None)
    serve.add_argument(
        "--api-key", default=None, help="SGLang's --api-key: every route but /health* and "
        "/metrics needs Authorization: Bearer <key>",
    )  # fmt: skip
    serve.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    serve.add_argument("--ssl-keyfile", default=None, help="the key of --ssl-certfile")
    serve.add_argument(
        "--ssl-ca-certs", default=None, help="require client certificates signed by this CA"
    )
    serve.add_argument(
        "--model-path", default="pd-worker/toy-model",
        help="the model reported in /server_info and /model_info (default pd-worker/toy-model)",
    )  # fmt: skip
    serve.add_argument(
        "--served-model-name", default=None,
        help="the model name of /v1/models and the OpenAI replies (default: --model-path)",
    )  # fmt: skip
    serve.add_argument("--decode-cuda-graph-memory-gb", type=float, default=0.6)
    serve.add_argument("--gpu-free-memory-gb", type=float, default=8.0)
    serve.add_argument(
        "--engine", choices=ENGINES, default="timing",
        help="timing: the timing model (default); torch: a small real model over a real KV pool",
    )  # fmt: skip
    serve.add_argument(
        "--kv-transfer", choices=TRANSPORTS, default="mooncake",
        help="the torch engine's KV transport (mooncake TransferEngine over TCP, or plain TCP)",
    )  # fmt: skip
    serve.add_argument(
        "--model-config", default=None, metavar="PATH",
        help="the torch engine's model config (default: configs/torch-model.json)",
    )  # fmt: skip
    serve.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    serve.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is gone (clusters)"
    )
    _add_timing_flags(serve)
    _add_registration_flags(serve)
    cluster = sub.add_parser("cluster", help="start a cluster of worker processes")
    cluster.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    cluster.add_argument("--decode", type=int, default=2, help="decode workers (default 2)")
    cluster.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="HTTP ports from here; bootstrap ports from here + 1000",
    )
    cluster.add_argument("--host", default="127.0.0.1", help="address to listen on")
    cluster.add_argument(
        "--speed", type=float, default=1.0,
        help="the timing model's speed (default 1.0; 0: no simulated GPU time)",
    )  # fmt: skip
    cluster.add_argument(
        "--profile", choices=sorted(PROFILES), default=None,
        help="named timing model calibrated to a real GPU",
    )  # fmt: skip
    cluster.add_argument(
        "--no-role-switch", action="store_true", help="launch without --enable-pd-role-switch"
    )
    cluster.add_argument(
        "--engine", choices=ENGINES, default="timing",
        help="timing: the timing model (default); torch: a small real model over a real KV pool",
    )  # fmt: skip
    cluster.add_argument(
        "--kv-transfer", choices=TRANSPORTS, default=None,
        help="the torch engine's KV transport (default mooncake)",
    )  # fmt: skip
    return parser


def _config(args: argparse.Namespace) -> WorkerConfig:
    knobs = {
        f.name: getattr(args, f.name)
        for f in fields(TimingModel)
        if getattr(args, f.name) is not None
    }
    if args.engine == "torch":
        knobs.setdefault("max_total_num_tokens", TORCH_KV_SLOTS)
    return WorkerConfig(
        role=args.role,
        host=args.host,
        port=args.port,
        bootstrap_port=args.bootstrap_port,
        enable_pd_role_switch=args.enable_pd_role_switch,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        admin_api_key=args.admin_api_key,
        api_key=args.api_key,
        enable_faults=args.enable_faults,
        decode_cuda_graph_memory_gb=args.decode_cuda_graph_memory_gb,
        gpu_free_memory_gb=args.gpu_free_memory_gb,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        timing=profile(args.profile, **knobs),
        engine=args.engine,
        kv_transfer=args.kv_transfer,
        model_config=args.model_config,
    )


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "cluster":
        return _run_cluster(parser, args)
    config = _config(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    registration = _registration(parser, args)
    if config.engine == "torch":
        _check_model_config(parser, config.model_config)
    try:
        if not config.regular:
            check_can_listen(config.host, config.bootstrap_port or 0, "--bootstrap-port")
        check_can_listen(config.host, config.port, "--port")
    except ListenError as exc:
        parser.error(str(exc))
    # torch's CPU build warns on import when NumPy is absent; the torch engine never uses NumPy.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        _run(serve(config, args.parent_pid, registration))
    except OSError as exc:
        print(f"pd-worker: error: cannot listen: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except PlaneUnavailable as exc:
        print(f"pd-worker: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_model_config(parser: argparse.ArgumentParser, path: str | None) -> None:
    """The torch engine's model config is read before anything starts (a usage error names
    the file)."""
    from pd_worker.torch_engine.config import DEFAULT_MODEL_CONFIG, ModelConfig, ModelConfigError

    try:
        ModelConfig.load(path or DEFAULT_MODEL_CONFIG)
    except ModelConfigError as exc:
        parser.error(f"--model-config: {exc}")


def _run(coro: object) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]
        return
    uvloop.run(coro)  # type: ignore[arg-type]


async def serve(
    config: WorkerConfig,
    parent_pid: int | None = None,
    registration: RegistrationSettings | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, or until ``parent_pid`` is no longer our parent; with
    ``registration``, registered in etcd from the moment the listener serves until then."""
    from aiohttp import web

    from pd_worker.app import WORKER, build_app
    from pd_worker.registration import registered

    stop = _stop_event(parent_pid)
    app = build_app(config)
    # A client that goes away cancels its request, as SGLang aborts disconnected requests: a
    # router cancelling a prefill leg must not leave the room held until the room timeout.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port, ssl_context=config.ssl_context())
        await site.start()
        logging.getLogger("pd_worker").info(
            "%s worker on %s, bootstrap port %s",
            config.role,
            config.url,
            app[WORKER].engine.bootstrap_port,
        )
        async with registered(app[WORKER].engine, registration, app[WORKER].registry):
            await stop.wait()
    finally:
        await runner.cleanup()


def _stop_event(parent_pid: int | None) -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (or the parent's exit). Installed before the worker
    serves: a signal that arrived before would kill it at once, leaving its etcd record to
    expire instead of being revoked."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if parent_pid is not None:
        _watch_parent(loop, parent_pid, stop)
    return stop


def _watch_parent(loop: asyncio.AbstractEventLoop, parent_pid: int, stop: asyncio.Event) -> None:
    """Stop when the launching process exits (a killed test run must not leak workers).

    A pidfd becomes readable when its process exits; where pidfds are unavailable the worker
    simply outlives its parent, as any server would.
    """
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):
        logging.getLogger("pd_worker").warning("cannot watch parent %d", parent_pid)
        return
    loop.add_reader(pidfd, stop.set)


def _run_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from pd_worker.cluster import WorkerCluster, WorkerStartError

    if args.prefill < 0 or args.decode < 0 or args.prefill + args.decode == 0:
        parser.error("--prefill and --decode must be >= 0 and start at least one worker")
    if args.speed < 0:
        parser.error("--speed must be >= 0")
    if args.base_port is not None and not 0 < args.base_port < 64000:
        parser.error("--base-port must be in 1..63999")
    cluster = WorkerCluster(
        prefill=args.prefill,
        decode=args.decode,
        speed=args.speed,
        base_port=args.base_port,
        host=args.host,
        enable_pd_role_switch=not args.no_role_switch,
        profile=args.profile,
        engine=args.engine,
        kv_transfer=args.kv_transfer,
    )
    try:
        cluster.start()
    except WorkerStartError as exc:
        print(f"pd-worker: error: {exc}", file=sys.stderr)
        return 1
    try:
        for worker in cluster.workers:
            print(
                f"{worker.role:8s} {worker.url}  bootstrap_port={worker.bootstrap_port}", flush=True
            )
        _block_until_signal()
    finally:
        cluster.stop()
    return 0


def _block_until_signal() -> None:
    """Wait for SIGINT or SIGTERM without a handler racing the cluster shutdown."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.sigwait({signal.SIGINT, signal.SIGTERM})
