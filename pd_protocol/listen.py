"""Whether a listener can bind its address, checked before anything starts, and why not in
one line naming the flag to change: shared by the ``pd-router`` and ``pd-worker`` command lines,
which report it and exit 2 instead of a traceback."""

from __future__ import annotations

import errno
import socket
from typing import Any


class ListenError(Exception):
    """A listener cannot bind ``host:port`` (``port_flag`` names the option that set the port)."""

    def __init__(self, host: str, port: int, port_flag: str, cause: OSError) -> None:
        super().__init__(describe_bind_failure(host, port, port_flag, cause))


def describe_bind_failure(host: str, port: int, port_flag: str, cause: OSError) -> str:
    where = f"{host}:{port}"
    if isinstance(cause, socket.gaierror):
        return f"--host {host}: the name does not resolve ({cause.strerror})"
    if cause.errno == errno.EADDRINUSE:
        return f"{port_flag} {port}: {where} is already in use (another process listens there)"
    if cause.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this host (cannot listen on {where})"
    if cause.errno == errno.EACCES:
        return f"{port_flag} {port}: not allowed to listen on {where} (ports below 1024 need root)"
    return f"cannot listen on {where}: {cause.strerror or cause}"


def listen_addresses(host: str, port: int, port_flag: str = "--port") -> list[tuple[Any, ...]]:
    """What a listener on ``host`` binds (``getaddrinfo`` entries; both families for a wildcard
    host); ListenError for a host that does not resolve."""
    try:
        return socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ListenError(host, port, port_flag, exc) from None


def check_can_listen(host: str, port: int, port_flag: str) -> None:
    """Bind every address of ``host:port`` and let go at once, with the options asyncio's
    servers use, so that a port in use or an address of another host is reported before the
    process starts anything (ListenError)."""
    for family, kind, proto, _, address in listen_addresses(host, port, port_flag):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host lacks: asyncio's servers skip it too
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise ListenError(host, port, port_flag, exc) from None
