"""TLS on both sides of the router: HTTPS to its clients, and https:// (optionally mutual) to
its workers.

The ``[tls]`` section names PEM files; the stdlib :mod:`ssl` module does all the work. A
context is built once at start-up and shared: the listener serves with
:func:`server_context`, and every connection to a worker (the legs' pool, the shared aiohttp
session of probes, fan-outs and aborts, the control session of conversions) verifies the
worker's certificate and host name with :func:`worker_context`.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class TLSConfig:
    """The ``[tls]`` section. ``cert_path``/``key_path``: serve HTTPS to clients (both or
    neither). ``ca_cert_path``: trust this CA for https:// workers (else the system store); a
    list of files trusts each (the peers' ``--ca-cert-paths`` takes several).
    ``client_cert_path``/``client_key_path``: present this certificate to workers (mTLS)."""

    cert_path: str | None = None
    key_path: str | None = None
    ca_cert_path: str | tuple[str, ...] | None = None
    client_cert_path: str | None = None
    client_key_path: str | None = None

    @property
    def serves_https(self) -> bool:
        return self.cert_path is not None and self.key_path is not None

    @property
    def ca_files(self) -> tuple[str, ...]:
        """The CA files named by ``ca_cert_path`` (none: the system store)."""
        ca = self.ca_cert_path
        if ca is None:
            return ()
        return (ca,) if isinstance(ca, str) else ca

    @property
    def configures_workers(self) -> bool:
        """Whether any worker-side key is set (else https:// workers get the defaults)."""
        return any(
            path is not None
            for path in (self.ca_cert_path, self.client_cert_path, self.client_key_path)
        )


def server_context(tls: TLSConfig) -> ssl.SSLContext | None:
    """The listener's context (TLS 1.2 or newer, the stdlib's server defaults), or None when
    the router serves plain HTTP. Raises OSError or ssl.SSLError for unreadable files or a
    key that does not match its certificate."""
    if tls.cert_path is None or tls.key_path is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_path, tls.key_path)
    return context


def worker_context(tls: TLSConfig) -> ssl.SSLContext:
    """The context of every connection to an https:// worker: the worker's certificate is
    verified (against the ``ca_cert_path`` files, else the system store) together with its
    host name, and the client certificate is presented when configured. Raises OSError or
    ssl.SSLError as :func:`server_context` does."""
    cas = tls.ca_files
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cas[0] if cas else None)
    for ca in cas[1:]:
        context.load_verify_locations(cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.client_cert_path is not None and tls.client_key_path is not None:
        context.load_cert_chain(tls.client_cert_path, tls.client_key_path)
    return context
