"""The roles of a worker, shared by the control process and the data planes: the two of a PD
worker, and a regular (colocated, non-disaggregated) server that answers a request alone."""

from __future__ import annotations

from enum import StrEnum
from urllib.parse import urlsplit

from pd_protocol.cluster import record_role

# The KV bootstrap port of a prefill that does not say its own (SGLang's default).
DEFAULT_BOOTSTRAP_PORT = 8998


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    REGULAR = "regular"

    @property
    def other(self) -> Role:
        """The role a conversion moves a PD worker to (a regular server has none)."""
        if self is Role.REGULAR:
            raise ValueError("a regular worker has no other role")
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL

    @property
    def disaggregated(self) -> bool:
        return self is not Role.REGULAR


# The roles a conversion moves a worker between.
PD_ROLES = (Role.PREFILL, Role.DECODE)


def worker_role(value: object) -> Role | None:
    """The role a worker reports (``disaggregation_mode`` or the extension's ``role``); SGLang
    names a regular server's mode ``null``."""
    if not isinstance(value, str):
        return None
    try:
        return Role(record_role(value.lower()))
    except ValueError:
        return None


def bootstrap_host(url: str) -> str:
    """The host part of a worker url as SGLang's decode wants it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host
