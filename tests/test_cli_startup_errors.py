"""A user mistake at start-up is one line naming what is wrong and exit status 2, never a
traceback: a port in use, an address not on this host, a host that does not resolve, a bad
flag value or a file that is not there, for ``pd-router`` and ``pd-worker`` alike."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from pd_worker.cluster import free_port as any_free_port
from tests.cli_process import NOWHERE, PD_ROUTER, PD_WORKER, one_line_error, run

# TEST-NET-3 (RFC 5737): never assigned to this machine.
NOT_HERE = "203.0.113.5"
UNRESOLVABLE = "no-such-host.invalid"


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def serve_args(binary: str, host: str, port: int) -> list[str]:
    if binary == PD_ROUTER:
        return [*NOWHERE, "--host", host, "--port", str(port)]
    return ["serve", "--host", host, "--port", str(port), "--bootstrap-port", str(any_free_port())]


BINARIES = pytest.mark.parametrize("binary", [PD_ROUTER, PD_WORKER], ids=["router", "worker"])


@BINARIES
def test_a_port_in_use_is_one_line_naming_the_port(binary, taken_port):
    line = one_line_error(run(binary, *serve_args(binary, "127.0.0.1", taken_port)))
    assert f"127.0.0.1:{taken_port}" in line and "already in use" in line


@BINARIES
def test_an_address_not_on_this_host_is_one_line_naming_it(binary, free_port):
    line = one_line_error(run(binary, *serve_args(binary, NOT_HERE, free_port())))
    assert NOT_HERE in line and "not an address of this host" in line


@BINARIES
def test_a_host_that_does_not_resolve_is_one_line_naming_it(binary, free_port):
    line = one_line_error(run(binary, *serve_args(binary, UNRESOLVABLE, free_port())))
    assert UNRESOLVABLE in line and "does not resolve" in line


def test_a_worker_bootstrap_port_in_use_names_the_bootstrap_flag(taken_port, free_port):
    result = run(
        PD_WORKER, "serve", "--port", str(free_port()), "--bootstrap-port", str(taken_port)
    )
    line = one_line_error(result)
    assert "--bootstrap-port" in line and str(taken_port) in line


def test_an_unknown_worker_log_level_is_a_usage_error_naming_the_choices():
    line = one_line_error(run(PD_WORKER, "serve", "--log-level", "verbose"))
    assert "--log-level" in line and "'verbose'" in line and "debug" in line


def test_a_missing_model_config_is_one_line_naming_the_file(tmp_path):
    missing = tmp_path / "model.json"
    line = one_line_error(
        run(PD_WORKER, "serve", "--engine", "torch", "--model-config", str(missing))
    )
    assert "--model-config" in line and str(missing) in line


def test_a_missing_admin_key_file_is_one_line_naming_the_file(tmp_path):
    missing = tmp_path / "admin.key"
    line = one_line_error(
        run(PD_ROUTER, *NOWHERE, "--host", "127.0.0.1", "--admin-api-key-file", str(missing))
    )
    assert "admin_api_key_file" in line and str(missing) in line


def test_cluster_without_etcd_is_refused_as_the_reverse_is(free_port):
    line = one_line_error(
        run(
            PD_ROUTER,
            *NOWHERE,
            "--host",
            "127.0.0.1",
            "--cluster",
            "prod",
            "--port",
            str(free_port()),
        )
    )
    assert "--cluster" in line and "--etcd" in line


def test_a_missing_worker_certificate_is_one_line_naming_the_file(tmp_path):
    missing = tmp_path / "cert.pem"
    line = one_line_error(
        run(PD_WORKER, "serve", "--ssl-certfile", str(missing), "--ssl-keyfile", str(missing))
    )
    assert "ssl_certfile" in line and str(missing) in line


def test_the_demo_on_a_port_in_use_is_one_line_before_any_worker_starts(taken_port):
    line = one_line_error(run(PD_ROUTER, "demo", "--port", str(taken_port)))
    assert f"127.0.0.1:{taken_port}" in line and "already in use" in line


def test_kubernetes_discovery_without_credentials_is_one_line_naming_where_it_looked(
    tmp_path, free_port
):
    args = ["--service-discovery", "--selector", "app=sglang", "--port", str(free_port())]
    env = {"HOME": str(tmp_path), "KUBECONFIG": ""}
    line = one_line_error(run(PD_ROUTER, *args, env=env))
    assert "no Kubernetes credentials" in line
    assert "$KUBECONFIG" in line and "~/.kube/config" in line
    assert "KUBERNETES_SERVICE_HOST" in line
