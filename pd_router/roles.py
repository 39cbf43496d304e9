"""The two roles of a PD worker, shared by the control process and the data planes."""

from __future__ import annotations

from enum import StrEnum
from urllib.parse import urlsplit

# The KV bootstrap port of a prefill that does not say its own (SGLang's default).
DEFAULT_BOOTSTRAP_PORT = 8998


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def other(self) -> Role:
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


def bootstrap_host(url: str) -> str:
    """The host part of a worker url as SGLang's decode wants it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host
