"""Self-registration of an SGLang server in a pd-router cluster's etcd (the ``--pd-router-*``
launcher flags), kept free of SGLang and FastAPI imports so it is testable anywhere.

The launcher takes its own flags out of the command line before SGLang parses the rest
(:func:`split_registration_args`), then :func:`install_registration` wraps the app's lifespan:
once SGLang's own startup is done, the server's record is put in etcd under a lease, refreshed
in the server's event loop, and revoked at shutdown before SGLang's own teardown. The role and
bootstrap port in the record are the extension's live ones (docs/self-registration.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import aiohttp

from pd_protocol.cluster import DEFAULT_LEASE_TTL_SECS, DEFAULT_PREFIX
from pd_protocol.extension import PDExtension
from pd_protocol.registration import FlagNames, RegistrationSettings
from server_patch.preflight import LaunchError

logger = logging.getLogger("server_patch")

FLAGS = FlagNames("--pd-router-etcd", "--pd-router-cluster", "--pd-router-advertise-url")

Lifespan = Callable[[Any], contextlib.AbstractAsyncContextManager[Any]]


class _Parser(argparse.ArgumentParser):
    """Our flags only; a bad one is a LaunchError (the launcher exits 2 with its message)."""

    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: a prefix of one of our flags must not swallow an SGLang flag.
    parser = _Parser(prog="server_patch.launch_server", add_help=False, allow_abbrev=False)
    parser.add_argument(FLAGS.etcd, dest="etcd", action="append", default=[])
    parser.add_argument(FLAGS.cluster, dest="cluster", default=None)
    parser.add_argument("--pd-router-cluster-prefix", dest="prefix", default=DEFAULT_PREFIX)
    parser.add_argument(FLAGS.advertise_url, dest="advertise_url", default=None)
    parser.add_argument(
        "--pd-router-etcd-lease-ttl", dest="lease_ttl", type=int, default=DEFAULT_LEASE_TTL_SECS
    )
    return parser


def split_registration_args(argv: list[str]) -> tuple[RegistrationSettings | None, list[str]]:
    """Our ``--pd-router-*`` flags as settings (None without ``--pd-router-etcd``) and the
    arguments left for SGLang, in their order. LaunchError for unusable flags."""
    args, rest = _parser().parse_known_args(argv)
    try:
        settings = RegistrationSettings.from_flags(
            FLAGS, args.etcd, args.cluster, args.prefix, args.advertise_url, args.lease_ttl
        )
    except ValueError as exc:
        raise LaunchError(f"--pd-router-* flags: {exc}") from exc
    return settings, rest


def install_registration(
    app: Any, extension: PDExtension, settings: RegistrationSettings, own_url: str
) -> None:
    """Register the server while ``app`` (a Starlette/FastAPI app) is up.

    SGLang's app has a lifespan of its own, so startup/shutdown event handlers would never run;
    the registration wraps the router's ``lifespan_context`` instead: it starts after SGLang's
    startup (the server is about to serve) and stops before SGLang's shutdown.
    """
    app.router.lifespan_context = registering(
        app.router.lifespan_context, extension, settings, own_url
    )


def registering(
    lifespan: Lifespan, extension: PDExtension, settings: RegistrationSettings, own_url: str
) -> Lifespan:
    """``lifespan`` with the server registered between its startup and its shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan_registered(app: Any) -> AsyncIterator[Any]:
        async with lifespan(app) as state:
            first_role = await extension.live_role()
            async with aiohttp.ClientSession() as session:
                registration = settings.registration(
                    session,
                    own_url,
                    lambda: (extension.known_role or first_role, extension.bootstrap_port()),
                )
                await registration.start()
                logger.info(
                    "registering %s in pd-router cluster %r through etcd %s",
                    registration.key,
                    settings.cluster,
                    ", ".join(settings.endpoints),
                )
                try:
                    yield state
                finally:
                    await registration.stop()

    return lifespan_registered
