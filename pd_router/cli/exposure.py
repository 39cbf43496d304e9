"""Who can reach the router's admin API, settled before the router serves.

The admin API adds workers (so the router probes any url it is given), converts and aborts. On
an address other hosts can reach it is served only behind a key, unless the operator says
``--allow-unauthenticated``; on a loopback address it may run open, as only this host reaches
it. The key comes from ``$PD_ROUTER_ADMIN_KEY``, a file (``--admin-api-key-file``,
``admin_api_key_file``) or ``--admin-api-key``/``admin_api_key``; start-up logs one line saying
which, or that the admin API is open and to whom.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

from pd_protocol.listen import listen_addresses
from pd_router.config import RouterConfig

ADMIN_KEY_ENV = "PD_ROUTER_ADMIN_KEY"


class Exposed(Exception):
    """The router would serve an open admin API to other hosts without being told to."""


def loopback_only(host: str, port: int) -> bool:
    """Whether every address a listener on ``host`` binds is a loopback address."""
    return all(
        ipaddress.ip_address(str(entry[4][0]).split("%", 1)[0]).is_loopback
        for entry in listen_addresses(host, port)
    )


class Exposure(NamedTuple):
    """Who can use the admin API, as start-up says it (``open``: without a key)."""

    line: str
    open: bool


def admin_exposure(config: RouterConfig, key_source: str) -> Exposure:
    """Who can use the admin API (``key_source``: where the key came from); Exposed when an open
    admin API would be reachable from other hosts and ``allow_unauthenticated`` is not set."""
    where = f"{config.host}:{config.port}"
    if config.admin_api_key is not None:
        return Exposure(f"admin API requires the key (from {key_source})", open=False)
    if loopback_only(config.host, config.port):
        return Exposure(
            f"admin API is OPEN to this host only: no admin key, and {where} is loopback",
            open=True,
        )
    if not config.allow_unauthenticated:
        raise Exposed(
            f"refusing to serve the admin API without a key on {where}, which other hosts can "
            f"reach: set ${ADMIN_KEY_ENV} or --admin-api-key-file FILE, bind --host 127.0.0.1, "
            "or pass --allow-unauthenticated"
        )
    return Exposure(
        f"admin API is OPEN: anyone who reaches {where} can add and remove workers, convert "
        "and abort (--allow-unauthenticated)",
        open=True,
    )
