"""TLS on both sides: the router serves HTTPS to clients (``[tls] cert_path``/``key_path``) and
verifies https:// workers against ``ca_cert_path``, presenting ``client_cert_path`` to workers
that require client certificates (reference workers with ``--ssl-ca-certs``: mTLS).

Certificates are made at test time with the ``openssl`` command (:mod:`tests.tls_helpers`).
"""

from __future__ import annotations

import asyncio
import io
import ssl
from pathlib import Path

import httpx
import pytest

from pd_router.cli.admin_client import status as admin_status
from pd_router.config import ConfigError, load_config
from pd_router.control.workers import Role
from pd_router.dataplane.legs.connection import UpstreamConnectError, UpstreamDisconnected
from pd_router.dataplane.legs.pool import LegLimits
from pd_worker.cli import main as worker_main
from pd_worker.cluster import ClusterTLS, WorkerCluster
from tests.router_helpers import assert_paired, generate_body, running_router, sse_events
from tests.tls_helpers import Pki, make_pki, requires_openssl

pytestmark = requires_openssl

TOKENS = 3


@pytest.fixture(scope="module")
def pki_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pki")


@pytest.fixture(scope="module")
def pki(pki_dir: Path) -> Pki:
    return make_pki(pki_dir)


@pytest.fixture(scope="module")
def other_pki(pki_dir: Path) -> Pki:
    """An unrelated CA: its certificates must be refused where ``pki``'s are trusted."""
    return make_pki(pki_dir, "other")


@pytest.fixture(scope="module")
def mtls_cluster(pki: Pki):
    """1P1D reference workers serving HTTPS and requiring a client certificate from ``pki``."""
    tls = ClusterTLS(pki.server_cert, pki.server_key, pki.ca_cert, pki.client_cert, pki.client_key)
    with WorkerCluster(prefill=1, decode=1, speed=0.0, tls=tls) as cluster:
        yield cluster


def worker_tls(pki: Pki) -> dict[str, str]:
    return {
        "ca_cert_path": pki.ca_cert,
        "client_cert_path": pki.client_cert,
        "client_key_path": pki.client_key,
    }


def client_verifying(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pki.ca_cert)


# --- configuration ---------------------------------------------------------------------------


def test_cert_path_without_key_path_names_key_path(pki):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tls": {"cert_path": pki.server_cert}})
    assert err.value.key == "tls.key_path"


def test_client_key_path_without_client_cert_path_names_client_key_path(pki):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tls": {"client_key_path": pki.client_key}})
    assert err.value.key == "tls.client_key_path"


def test_missing_ca_file_names_ca_cert_path(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tls": {"ca_cert_path": str(tmp_path / "absent.pem")}})
    assert err.value.key == "tls.ca_cert_path"


def test_one_missing_file_of_a_ca_list_names_ca_cert_path(pki, tmp_path):
    cas = [pki.ca_cert, str(tmp_path / "absent.pem")]
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tls": {"ca_cert_path": cas}})
    assert err.value.key == "tls.ca_cert_path"


def test_key_that_does_not_match_its_certificate_names_cert_path(pki):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tls": {"cert_path": pki.server_cert, "key_path": pki.client_key}})
    assert err.value.key == "tls.cert_path"


def test_ca_file_that_holds_no_certificate_names_ca_cert_path(pki):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"tls": {"ca_cert_path": pki.server_key}})
    assert err.value.key == "tls.ca_cert_path"


def test_worker_refuses_a_certificate_without_its_key(pki):
    with pytest.raises(SystemExit) as exited:
        worker_main(["serve", "--ssl-certfile", pki.server_cert])
    assert exited.value.code == 2


def test_worker_refuses_a_key_that_does_not_match_its_certificate(pki):
    argv = ["serve", "--ssl-certfile", pki.server_cert, "--ssl-keyfile", pki.client_key]
    with pytest.raises(SystemExit) as exited:
        worker_main(argv)
    assert exited.value.code == 2


# --- HTTPS to clients ------------------------------------------------------------------------


async def test_router_serves_https_that_a_client_verifies_against_the_ca(pd_cluster, pki):
    tls = {"cert_path": pki.server_cert, "key_path": pki.server_key}
    async with running_router(pd_cluster, tls=tls) as router:
        assert router.url.startswith("https://")
        async with router.client(verify=client_verifying(pki)) as http:
            response = await http.post("/generate", json=generate_body("over https", TOKENS))
    assert response.status_code == 200
    assert_paired(response.json(), "over https", TOKENS)


async def test_status_command_reads_an_https_router_with_a_private_ca(pd_cluster, pki):
    tls = {"cert_path": pki.server_cert, "key_path": pki.server_key}
    async with running_router(pd_cluster, tls=tls) as router:
        out = io.StringIO()
        argv = ["--router", router.url, "--cacert", pki.ca_cert]
        code = await asyncio.to_thread(admin_status, argv, out)
    assert code == 0
    assert all(url in out.getvalue() for url in pd_cluster.urls)


async def test_https_router_fails_the_handshake_of_a_client_trusting_another_ca(
    pd_cluster, pki, other_pki
):
    tls = {"cert_path": pki.server_cert, "key_path": pki.server_key}
    async with (
        running_router(pd_cluster, tls=tls) as router,
        router.client(verify=client_verifying(other_pki)) as http,
    ):
        with pytest.raises(httpx.ConnectError):
            await http.get("/health")


async def test_https_router_closes_a_connection_that_never_starts_its_handshake(pd_cluster, pki):
    tls = {"cert_path": pki.server_cert, "key_path": pki.server_key}
    async with running_router(pd_cluster, tls=tls, client_header_timeout_secs=0.3) as router:
        port = router.server.port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            async with asyncio.timeout(10.0):
                assert await reader.read() == b""
        finally:
            writer.close()


async def test_https_router_closes_a_connection_whose_request_head_stalls(pd_cluster, pki):
    tls = {"cert_path": pki.server_cert, "key_path": pki.server_key}
    async with running_router(pd_cluster, tls=tls, client_header_timeout_secs=0.3) as router:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", router.server.port, ssl=client_verifying(pki)
        )
        try:
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
            async with asyncio.timeout(10.0):
                assert await reader.read() == b""
        finally:
            writer.close()


# --- TLS and mTLS to workers -----------------------------------------------------------------


async def test_request_is_served_by_workers_requiring_client_certificates(mtls_cluster, pki):
    assert all(url.startswith("https://") for url in mtls_cluster.urls)
    async with running_router(mtls_cluster, tls=worker_tls(pki)) as router, router.client() as http:
        assert (await http.get("/readiness")).status_code == 200
        response = await http.post("/generate", json=generate_body("mutual", TOKENS))
    assert response.status_code == 200
    assert_paired(response.json(), "mutual", TOKENS)


async def test_stream_is_served_by_workers_requiring_client_certificates(mtls_cluster, pki):
    async with running_router(mtls_cluster, tls=worker_tls(pki)) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("streamed", TOKENS, stream=True))
    assert response.status_code == 200
    assert sse_events(response.text)[-1] == "[DONE]"


async def test_router_without_a_client_certificate_is_refused_by_mtls_workers(mtls_cluster, pki):
    tls = {"ca_cert_path": pki.ca_cert}
    async with running_router(mtls_cluster, tls=tls) as router, router.client() as http:
        assert (await http.get("/readiness")).status_code == 503
        refused = await http.post("/generate", json=generate_body("anonymous", TOKENS))
        assert refused.status_code == 503
        with pytest.raises((UpstreamDisconnected, UpstreamConnectError)):
            leg = await router.dataplane.legs.post(
                mtls_cluster.decode_urls[0] + "/generate", b"{}", {}, LegLimits()
            )
            await leg.read()


async def test_router_refuses_workers_whose_certificate_its_ca_did_not_sign(
    mtls_cluster, other_pki
):
    async with (
        running_router(mtls_cluster, tls=worker_tls(other_pki)) as router,
        router.client() as http,
    ):
        assert (await http.get("/readiness")).status_code == 503
        with pytest.raises(UpstreamConnectError):
            await router.dataplane.legs.post(
                mtls_cluster.decode_urls[0] + "/generate", b"{}", {}, LegLimits()
            )


async def test_fan_outs_reach_mtls_workers(mtls_cluster, pki):
    async with running_router(mtls_cluster, tls=worker_tls(pki)) as router, router.client() as http:
        response = await http.post("/flush_cache")
    assert response.status_code == 200
    assert [w["status"] for w in response.json()["workers"]] == [200, 200]


async def test_conversion_control_calls_reach_mtls_workers(mtls_cluster, pki):
    url = mtls_cluster.prefill_urls[0]
    convert = {"server_url": url, "new_role": "decode"}
    no_minimum = {"min_prefill": 0, "min_decode": 0}
    async with (
        running_router(mtls_cluster, tls=worker_tls(pki), conversion=no_minimum) as router,
        router.client(timeout=30.0) as http,
    ):
        converted = await http.post("/convert_pd_role", json=convert)
        assert converted.status_code == 200, converted.text
        assert router.state.registry.get(url).role is Role.DECODE
        back = await http.post("/convert_pd_role", json={**convert, "new_role": "prefill"})
        assert back.status_code == 200, back.text


async def test_a_list_of_cas_trusts_workers_signed_by_any_of_them(mtls_cluster, pki, other_pki):
    tls = {**worker_tls(pki), "ca_cert_path": [other_pki.ca_cert, pki.ca_cert]}
    async with running_router(mtls_cluster, tls=tls) as router, router.client() as http:
        response = await http.post("/generate", json=generate_body("two cas", TOKENS))
    assert response.status_code == 200
    assert_paired(response.json(), "two cas", TOKENS)
