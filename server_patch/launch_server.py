"""`python -m server_patch.launch_server <sglang launch_server args>`.

Starts SGLang exactly as `python -m sglang.launch_server` does (plugins, argument parsing,
`run_server`, process-tree cleanup), after checking the SGLang version and PD mode, turning on
`--enable-pd-role-switch` when missing, adding the extension routes and admission gate to
SGLang's FastAPI app before it serves, and handing SGLang a scheduler process function that
installs server_patch's scheduler changes first (server_patch/scheduler_hooks.py). With
`--pd-router-etcd URL --pd-router-cluster NAME` (taken out before SGLang parses its arguments)
the server registers itself in that pd-router cluster's etcd while it serves
(server_patch/registration.py, docs/self-registration.md).
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import sys
from typing import Any

from pd_protocol.registration import advertise_url
from server_patch.preflight import (
    ROLE_SWITCH_FLAG,
    LaunchError,
    ServingPlan,
    check_plan,
    check_version,
    with_role_switch,
)
from server_patch.registration import install_registration, split_registration_args
from server_patch.scheduler_rpc import SchedulerRpc

logger = logging.getLogger("server_patch")


def installed_sglang_version() -> str | None:
    """The installed SGLang distribution's version, or None when it is not installed."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def serving_plan(server_args: Any) -> ServingPlan:
    """Read the parsed SGLang arguments the launcher checks."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.environ import envs

    view = resolving_view(server_args)
    other_server = (
        view.encoder_only
        or view.smg_grpc_mode
        or view.grpc_mode
        or view.use_ray
        or envs.SGLANG_RUST_SERVER.get()
    )
    return ServingPlan(
        disaggregation_mode=str(view.disaggregation_mode),
        enable_pd_role_switch=bool(view.enable_pd_role_switch),
        tokenizer_worker_num=int(view.tokenizer_worker_num),
        transfer_backend=str(view.disaggregation_transfer_backend),
        python_http_server=not other_server,
    )


def server_url(server_args: Any) -> str:
    """The url routers reach this server at when no `--pd-router-advertise-url` is given."""
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(server_args)
    scheme = "https" if view.ssl_certfile else "http"
    return advertise_url(scheme, str(view.host), int(view.port))


def prepare(argv: list[str]) -> Any:
    """Check, parse and patch: the SGLang server arguments to run, with the routes installed
    (and the self-registration, with `--pd-router-etcd`)."""
    registration, argv = split_registration_args(argv)
    check_version(installed_sglang_version())
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from server_patch.sglang_backend import install_on_sglang_app

    load_plugins()
    server_args = prepare_server_args(argv)
    plan = serving_plan(server_args)
    for warning in check_plan(plan):
        logger.warning(warning)
    if not plan.enable_pd_role_switch:
        logger.info("adding %s (server_patch converts roles in process)", ROLE_SWITCH_FLAG)
        server_args = prepare_server_args(with_role_switch(argv, enabled=False))
    rpc = SchedulerRpc()
    extension = install_on_sglang_app(rpc)
    launch_with_scheduler_hooks(rpc)
    logger.info(
        "extension routes installed: GET /pd_role, POST /pd_drain, POST /convert_pd_role, "
        "POST /pd_forget_prefill"
    )
    if registration is not None:
        from sglang.srt.entrypoints import http_server

        install_registration(http_server.app, extension, registration, server_url(server_args))
    return server_args


def launch_with_scheduler_hooks(rpc: SchedulerRpc) -> None:
    """Make SGLang's HTTP `launch_server` (the one `run_server` calls) start its schedulers
    with `scheduler_hooks.run_scheduler_process` and tell `rpc` where their RPC socket is.

    SGLang takes both functions as arguments of `launch_server`; its `run_server` passes
    neither, so the module's `launch_server` is replaced by itself with these two given.
    """
    from sglang.srt.entrypoints import engine, http_server

    from server_patch import scheduler_hooks

    def init_tokenizer_manager(server_args: Any, port_args: Any) -> Any:
        rpc.record_port_args(port_args)
        return engine.init_tokenizer_manager(server_args, port_args)

    launch = getattr(http_server.launch_server, "func", http_server.launch_server)
    http_server.launch_server = functools.partial(
        launch,
        init_tokenizer_manager_func=init_tokenizer_manager,
        run_scheduler_process_func=scheduler_hooks.run_scheduler_process,
    )


def _log_to_stderr() -> None:
    """Our own handler, so SGLang's logging setup (done later, on the root logger) is untouched."""
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    _log_to_stderr()
    try:
        server_args = prepare(sys.argv[1:] if argv is None else argv)
    except LaunchError as error:
        logger.error("%s", error)
        return 2
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
