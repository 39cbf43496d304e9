"""The ``serve`` command line's parser and its help: ``--help`` lists pd-router's own options
and the few of the peers' it is run with every day, each with its default; ``--help-all`` adds
every other option of sglang-router and smg, which are parsed either way."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from typing import Any

from pd_router.cli.compat import Option
from pd_router.cli.usage import Parser
from pd_router.config import RouterConfig

USAGE = (
    "pd-router [serve] --prefill URL [BOOTSTRAP_PORT] ... --decode URL ... [OPTIONS]\n"
    "       pd-router [serve] --worker-urls URL ... [OPTIONS]\n"
    "       pd-router {demo,status,convert,autopilot} [OPTIONS]"
)
SHORT_USAGE = "pd-router [serve|demo|status|convert|autopilot] [OPTIONS]"
DESCRIPTION = (
    "Router for SGLang prefill/decode disaggregation. Serves by default (also 'pd-router serve' "
    "or 'pd-router launch'); 'pd-router demo|status|convert|autopilot --help' for the others."
)
EPILOG = (
    "Every key of the config file is in configs/router.toml; flags given here win over the "
    "file. The admin key: $PD_ROUTER_ADMIN_KEY, --admin-api-key-file or admin_api_key_file. "
    "pd-router also takes every option of sglang-router's launch_router and smg's 'smg launch' "
    "(--help-all lists them; docs/router.md says what each does)."
)
# Options the peers have too that a pd-router operator sets every day, with pd-router's words
# for them: --help lists them with pd-router's own; the rest of the peers' wait under --help-all.
EVERYDAY_PEER_OPTIONS = {
    "--host": "address to listen on; one other hosts can reach serves the admin API only with "
    "an admin key, or with --allow-unauthenticated",
    "--port": "port to listen on",
    "--prefill": "a prefill worker (repeat for each); BOOTSTRAP_PORT a number, 'none' or left "
    "out (then read from the worker's /server_info)",
    "--decode": "a decode worker (repeat for each)",
    "--worker-urls": "regular (non-PD) workers, each serving a request whole (alone: "
    "sglang-router's regular mode; beside --prefill/--decode: another model's pool)",
    "--policy": "how a worker is picked in every pool (an alias of the peers' logs what runs "
    "instead)",
    "--prefill-policy": "the prefill pool's policy (wins over --policy)",
    "--decode-policy": "the decode pool's policy (wins over --policy)",
    "--request-timeout-secs": "a whole request, both legs",
    "--log-level": "log level",
    "--tls-cert-path": "serve HTTPS with this certificate (PEM; with --tls-key-path)",
    "--tls-key-path": "the key of --tls-cert-path",
}


class HelpAll(argparse.Action):
    """``--help-all``: the help with every option, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        self.full_parser = kwargs.pop("full_parser")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        self.full_parser().print_help()
        parser.exit()


def build_parser(
    peer: Iterable[Option], native: Iterable[Option], show_all: bool = False
) -> Parser:
    """The ``serve`` parser: every option parses; its help shows the peers' other options only
    with ``show_all``."""
    peer, native = tuple(peer), tuple(native)
    parser = Parser(
        prog="pd-router",
        usage=USAGE,
        short_usage=SHORT_USAGE,
        version=True,
        description=DESCRIPTION,
        epilog=EPILOG,
    )
    parser.add_argument(
        "--help-all", action=HelpAll, full_parser=lambda: build_parser(peer, native, True),
        help="show every option, those of sglang-router and smg too, and exit",
    )  # fmt: skip
    parser.add_argument("--config", metavar="FILE", help="TOML config file (configs/router.toml)")
    everyday = parser.add_argument_group("workers and address")
    own = parser.add_argument_group("pd-router options")
    others = parser.add_argument_group(
        "options of sglang-router and smg (docs/router.md says what each does)"
    )
    by_name = {opt.names[0]: opt for opt in peer}
    for name, text in EVERYDAY_PEER_OPTIONS.items():
        add_option(everyday, by_name[name], shown=True, text=text)
    for opt in native:
        add_option(own, opt, shown=True)
    for opt in peer:
        if opt.names[0] not in EVERYDAY_PEER_OPTIONS:
            add_option(others, opt, shown=show_all)
    return parser


def add_option(
    group: argparse._ArgumentGroup, opt: Option, shown: bool, text: str | None = None
) -> None:
    """``opt`` in ``group``, its help ``text`` (else its own) with its default; hidden from the
    help unless ``shown``."""
    if shown:
        text = (text or option_help(opt)) + default_text(opt)
    group.add_argument(
        *opt.names, dest=opt.dest, help=text if shown else argparse.SUPPRESS,
        **opt.arity.add_kwargs(opt.names[0]),
    )  # fmt: skip


def option_help(opt: Option) -> str:
    return opt.help or opt.effect().replace("%", "%%")


def default_text(opt: Option) -> str:
    """`` (default: X)``: the config default the option overrides, for options that set a key
    as given (none for switches, converted values and empty defaults)."""
    if not opt.keys or opt.convert is not None:
        return ""
    value: Any = RouterConfig()
    for part in opt.keys[0].split("."):
        value = getattr(value, part, None)
    if value is None or isinstance(value, bool) or value in ((), ""):
        return ""
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    return f" (default: {shown})"
