"""Throwaway certificates for TLS tests, made with the ``openssl`` command at test time.

``make_pki(directory)`` writes a CA and two certificates it signs: a server certificate for
127.0.0.1 and localhost, and a client certificate (for mTLS). ``make_pki(directory, "other")``
makes an unrelated CA and its certificates, for the certificates a peer must refuse. Tests that
need these skip when ``openssl`` is missing (:data:`requires_openssl`).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

requires_openssl = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="the openssl command is needed to make certificates"
)

KEY_ARGS = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
# A whole configuration, so the system's openssl.cnf adds nothing of its own.
REQ_CONFIG = (
    "[req]\ndistinguished_name = dn\n[dn]\n"
    "[ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n"
    "subjectKeyIdentifier = hash\n"
)
LEAF_EXTENSIONS = (
    "basicConstraints=critical,CA:FALSE\n"
    "keyUsage=critical,digitalSignature,keyEncipherment\n"
    "subjectKeyIdentifier=hash\n"
    "authorityKeyIdentifier=keyid\n"
)


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files of one CA and the certificates it signed."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _leaf(directory: Path, name: str, ca: Path, ca_key: Path, usage: str) -> tuple[str, str]:
    key, csr, cert = (directory / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
    _openssl(
        "req", "-new", *KEY_ARGS, "-config", str(directory / "req.cnf"), "-keyout", str(key),
        "-out", str(csr), "-subj", f"/CN={name}",
    )  # fmt: skip
    extensions = directory / f"{name}.ext"
    extensions.write_text(LEAF_EXTENSIONS + usage)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-out", str(cert), "-extfile", str(extensions),
    )  # fmt: skip
    return str(cert), str(key)


def make_pki(directory: Path, name: str = "test") -> Pki:
    """A CA named ``name`` and its server and client certificates, under ``directory``."""
    directory = directory / name
    directory.mkdir(parents=True)
    ca, ca_key, config = directory / "ca.pem", directory / "ca.key", directory / "req.cnf"
    config.write_text(REQ_CONFIG)
    _openssl(
        "req", "-x509", *KEY_ARGS, "-config", str(config), "-extensions", "ca",
        "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", f"/CN={name} CA",
    )  # fmt: skip
    server = _leaf(
        directory, "server", ca, ca_key,
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )  # fmt: skip
    client = _leaf(directory, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    return Pki(str(ca), *server, *client)
