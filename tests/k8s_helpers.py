"""A real kube-apiserver on a real etcd for the Kubernetes discovery tests, and the few calls a
test makes to it (no scheduler, no kubelet: a test creates pods and writes their status).

The binary is built once by ``tests/k8s/build_kube_apiserver.sh`` (``make test`` runs it; about
6 minutes the first time, cached under ``~/.cache/pd-router``); without it these tests skip
with the reason. ``kube_apiserver`` (module scope) starts etcd and the API server (about 4 s)
with token authentication, RBAC, a service-account signing key and a certificate signed by a
throwaway CA; ``kube`` (function scope) gives each test a fresh namespace (a namespace never
finishes deleting without a controller manager) and an admin client in it::

    pod = await kube.create_pod("p0", {"app": "sglang", "role": "prefill"})
    await kube.set_status("p0", ip="127.0.0.2", ready=True)
    await kube.label("p0", role="decode")
    await kube.delete_pod("p0")
    token = await kube.service_account_token("pd-router")   # a real service-account JWT
    kube.server.kubeconfig(path, token, namespace=kube.namespace)

For the router: ``pods_for(kube, cluster)`` makes a Ready pod for each reference worker (pod IP
127.0.0.1, the worker's port in smg's ``smg.ai/worker-ports`` annotation);
``router_credentials(kube, tmp)`` applies docker/k8s/rbac.yaml and returns a kubeconfig of its
service account; ``discovery_router(kubeconfig, *args)`` runs ``pd-router ARGS`` as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from pd_worker.cluster import LOOPBACK, WorkerCluster, free_port
from tests.etcd_helpers import ETCD, EtcdServer
from tests.router_helpers import wait_until
from tests.router_process import RouterProcess
from tests.tls_helpers import Pki, make_pki

CACHE = Path(os.environ.get("PD_ROUTER_CACHE", Path.home() / ".cache" / "pd-router"))
KUBE_APISERVER = CACHE / "kube-apiserver"
BUILD_SCRIPT = Path(__file__).parent / "k8s" / "build_kube_apiserver.sh"
READY_TIMEOUT_S = 60.0
ADMIN_TOKEN = "pd-router-test-admin"
MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


def skip_reason() -> str | None:
    """Why the Kubernetes tests cannot run here, or None."""
    if not os.access(KUBE_APISERVER, os.X_OK):
        return (
            f"no kube-apiserver at {KUBE_APISERVER}: build it with {BUILD_SCRIPT} "
            "(make test does; about 6 minutes once)"
        )
    if ETCD is None:
        return "etcd not installed (Debian: apt-get install etcd-server; make test does it)"
    if shutil.which("openssl") is None:
        return "the openssl command is needed to make the API server's certificates"
    return None


class KubeDidNotStart(RuntimeError):
    """kube-apiserver exited or was not ready in time; carries the tail of its log."""


@dataclass
class KubeApiServer:
    """One kube-apiserver on loopback, on the etcd at ``etcd_url``."""

    workdir: Path
    etcd_url: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    pki: Pki | None = None
    ca_cert: str = ""
    started_in_s: float = 0.0

    @property
    def url(self) -> str:
        return f"https://{LOOPBACK}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "kube-apiserver.log"

    def _prepare(self) -> Pki:
        """The certificates, the service-account key and the token file, made once."""
        pki = make_pki(self.workdir)
        self.ca_cert = pki.ca_cert
        subprocess.run(
            ["openssl", "genrsa", "-out", str(self.workdir / "sa.key"), "2048"],
            check=True, capture_output=True,
        )  # fmt: skip
        (self.workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin,"system:masters"\n')
        return pki

    def start(self) -> KubeApiServer:
        """Start it (again after ``stop``: same port, keys and data) and return once it is
        ready."""
        if self.pki is None:
            self.pki = self._prepare()
        pki, sa_key, tokens = self.pki, self.workdir / "sa.key", self.workdir / "tokens.csv"
        command = [
            str(KUBE_APISERVER),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={LOOPBACK}",
            f"--secure-port={self.port}",
            "--insecure-port=0",
            f"--advertise-address={LOOPBACK}",
            "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'certs'}",
            f"--tls-cert-file={pki.server_cert}",
            f"--tls-private-key-file={pki.server_key}",
            "--service-cluster-ip-range=10.96.0.0/24",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=RBAC",
            "--disable-admission-plugins=ServiceAccount",
            "--logtostderr=true",
            "--v=0",
        ]
        started = time.monotonic()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = started + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise KubeDidNotStart(f"exited {self.process.returncode}: {self._log_tail()}")
            if self._ready():
                self.started_in_s = time.monotonic() - started
                return self
            time.sleep(0.1)
        self.stop()
        raise KubeDidNotStart(f"not ready within {READY_TIMEOUT_S}s: {self._log_tail()}")

    def stop(self) -> None:
        """Kill it (its state is in etcd; a graceful stop waits 10 s on its open watches)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def tls(self) -> ssl.SSLContext:
        """A client context that trusts this server's certificate."""
        return ssl.create_default_context(cafile=self.ca_cert)

    def _ready(self) -> bool:
        try:
            response = httpx.get(
                f"{self.url}/readyz", verify=self.tls(), timeout=1.0,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            )  # fmt: skip
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def kubeconfig(self, path: Path, token: str, namespace: str = "default") -> Path:
        """Write a kubeconfig for ``token`` (JSON, which is YAML) and return its path."""
        cluster = {"server": self.url, "certificate-authority": self.ca_cert}
        context = {"cluster": "test", "user": "test", "namespace": namespace}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": cluster}],
            "users": [{"name": "test", "user": {"token": token}}],
            "contexts": [{"name": "test", "context": context}],
            "current-context": "test",
        }
        path.write_bytes(orjson.dumps(config))
        return path

    def client(self, token: str = ADMIN_TOKEN) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, verify=self.tls(), timeout=10.0,
            headers={"Authorization": f"Bearer {token}"},
        )  # fmt: skip


@pytest.fixture(scope="module")
def kube_apiserver() -> Iterator[KubeApiServer]:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="pd-kube-") as tmp:
        etcd = EtcdServer(binary=ETCD, data_dir=Path(tmp) / "etcd" / "data")
        etcd.data_dir.parent.mkdir()
        etcd.start()
        server = KubeApiServer(workdir=Path(tmp), etcd_url=etcd.url)
        try:
            yield server.start()
        finally:
            server.stop()
            etcd.stop()


class KubeError(RuntimeError):
    """The API server refused a test's call."""


_namespaces = itertools.count(1)


class Namespace:
    """A fresh namespace on the test API server and the admin calls a test makes in it."""

    def __init__(self, server: KubeApiServer, http: httpx.AsyncClient, name: str) -> None:
        self.server = server
        self.http = http
        self.namespace = name

    def _pods(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods" + (f"/{name}" if name else "")

    async def call(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        content = orjson.dumps(body) if body is not None else None
        response = await self.http.request(method, path, content=content, **kwargs)
        if response.status_code >= 400:
            raise KubeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()

    async def create_pod(
        self, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None
    ) -> dict[str, Any]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "sglang", "image": "lmsysorg/sglang"}]},
        }
        return await self.call("POST", self._pods(), pod)

    async def set_status(
        self, name: str, *, ip: str | None = None, ready: bool, phase: str = "Running"
    ) -> dict[str, Any]:
        """Write the pod's status as a kubelet would: phase, pod IP and the Ready condition."""
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        if ip is not None:
            status.update(podIP=ip, podIPs=[{"ip": ip}])
        return await self.call(
            "PATCH", self._pods(name) + "/status", {"status": status}, headers=MERGE_PATCH
        )

    async def label(self, name: str, **labels: str | None) -> dict[str, Any]:
        body = {"metadata": {"labels": labels}}
        return await self.call("PATCH", self._pods(name), body, headers=MERGE_PATCH)

    async def get_pod(self, name: str) -> dict[str, Any]:
        return await self.call("GET", self._pods(name))

    async def labels(self, name: str) -> dict[str, str]:
        return (await self.get_pod(name))["metadata"].get("labels") or {}

    async def delete_pod(self, name: str) -> None:
        await self.call("DELETE", self._pods(name), {"gracePeriodSeconds": 0})

    async def service_account_token(self, name: str) -> str:
        """Create service account ``name`` and a token for it (the TokenRequest API: the JWT
        a pod of that account has mounted)."""
        account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
        base = f"/api/v1/namespaces/{self.namespace}/serviceaccounts"
        await self.call("POST", base, account)
        request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}}
        reply = await self.call("POST", f"{base}/{name}/token", request)
        return reply["status"]["token"]

    async def apply(self, document: dict[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Create one manifest object in this namespace (server-side dry run with
        ``dry_run``); its namespace, and its subjects' (a RoleBinding), become this one."""
        document = dict(document)
        metadata = dict(document.get("metadata") or {})
        metadata["namespace"] = self.namespace
        document["metadata"] = metadata
        if "subjects" in document:
            document["subjects"] = [
                {**subject, "namespace": self.namespace} for subject in document["subjects"]
            ]
        params = {"dryRun": "All"} if dry_run else {}
        return await self.call("POST", collection_path(document, self.namespace), document,
                               params=params)  # fmt: skip

    async def apply_file(self, path: Path, dry_run: bool = False) -> list[dict[str, Any]]:
        documents = [doc for doc in yaml.safe_load_all(path.read_bytes()) if doc]  # noqa: ASYNC240
        return [await self.apply(doc, dry_run) for doc in documents]


# The kinds the manifests in docker/k8s/ and the tests create: kind -> (API prefix, plural).
KINDS = {
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "StatefulSet": ("/apis/apps/v1", "statefulsets"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
}


def collection_path(document: dict[str, Any], namespace: str) -> str:
    prefix, plural = KINDS[document["kind"]]
    return f"{prefix}/namespaces/{namespace}/{plural}"


@pytest.fixture
async def kube(kube_apiserver: KubeApiServer) -> AsyncIterator[Namespace]:
    name = f"t{os.getpid()}-{next(_namespaces)}"
    async with kube_apiserver.client() as http:
        ns = Namespace(kube_apiserver, http, name)
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        await ns.call("POST", "/api/v1/namespaces", body)
        try:
            yield ns
        finally:
            with contextlib.suppress(KubeError, httpx.HTTPError):
                await ns.call("DELETE", f"/api/v1/namespaces/{name}")


# --- routers with discovery, and the pods of reference workers ---------------------------------

ROLE_SELECTORS = ("--prefill-selector", "app=sglang", "role=prefill",
                  "--decode-selector", "app=sglang", "role=decode")  # fmt: skip
PORTS_ANNOTATION = "smg.ai/worker-ports"
ROUTER_START_S = 20.0
ROUTER_STOP_S = 10.0


def worker_annotations(url: str) -> dict[str, str]:
    """The annotation that sends a pod's traffic to a reference worker's port on loopback."""
    return {PORTS_ANNOTATION: url.rsplit(":", 1)[1]}


async def worker_pod(kube: Namespace, name: str, url: str, role: str, ready: bool = True) -> None:
    """A pod labelled ``app=sglang, role=ROLE`` standing for the reference worker at ``url``
    (pod IP 127.0.0.1, its port in the annotation), Running and Ready when ``ready``."""
    await kube.create_pod(name, {"app": "sglang", "role": role}, worker_annotations(url))
    await kube.set_status(name, ip=LOOPBACK, ready=ready)


async def pods_for(kube: Namespace, cluster: WorkerCluster) -> None:
    """A Ready pod for each worker of ``cluster``: ``p0``, ``p1``, ... for its prefills, ``d0``,
    ... for its decodes."""
    for role, urls in (("prefill", cluster.prefill_urls), ("decode", cluster.decode_urls)):
        for i, url in enumerate(urls):
            await worker_pod(kube, f"{role[0]}{i}", url, role)


async def router_credentials(
    kube: Namespace, tmp: Path, verbs: tuple[str, ...] | None = None
) -> Path:
    """A kubeconfig for the service account of docker/k8s/rbac.yaml in ``kube``'s namespace,
    with that file's Role (its verbs replaced by ``verbs`` when given)."""
    rbac = Path(__file__).parent.parent / "docker" / "k8s" / "rbac.yaml"
    for document in yaml.safe_load_all(rbac.read_bytes()):
        if document["kind"] == "Role" and verbs is not None:
            document["rules"] = [{**rule, "verbs": list(verbs)} for rule in document["rules"]]
        if document["kind"] != "ServiceAccount":
            await kube.apply(document)
    token = await kube.service_account_token("pd-router")
    return kube.server.kubeconfig(tmp / f"kubeconfig-{kube.namespace}", token, kube.namespace)


class DiscoveryRouter(RouterProcess):
    """A ``pd-router`` process started from its command line, and how to look at it."""

    async def workers(self) -> dict[str, dict[str, Any]]:
        """The router's workers by url (``GET /workers``)."""
        async with self.client() as http:
            listing = (await http.get("/workers")).json()
        return {w["url"]: w for w in listing["workers"]}

    async def pools(self) -> dict[str, str]:
        """url -> role of the healthy ACTIVE workers."""
        return {
            url: w["role"]
            for url, w in (await self.workers()).items()
            if w["state"] == "active" and w["healthy"]
        }

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of ``name`` whose labels include ``labels``."""
        async with self.client() as http:
            text = (await http.get("/metrics")).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.asynccontextmanager
async def discovery_router(
    kubeconfig: Path | None, *args: str, env: dict[str, str] | None = None,
    wrap: tuple[str, ...] = (),
) -> AsyncIterator[DiscoveryRouter]:  # fmt: skip
    """``pd-router ARGS`` on a free port with fast health probes and ``KUBECONFIG``, started
    (answering /liveness) and stopped with SIGTERM; ``wrap`` is a command line it runs under."""
    port = free_port()
    argv = [
        *wrap, sys.executable, "-m", "pd_router.cli", "--host", LOOPBACK, "--port", str(port),
        "--log-format", "text", "--health-check-interval-secs", "0.2",
        "--health-failure-threshold", "2", "--health-success-threshold", "1", *args,
    ]  # fmt: skip
    child_env = {**os.environ, **(env or {})}
    if kubeconfig is not None:
        child_env["KUBECONFIG"] = str(kubeconfig)
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.DEVNULL, stderr=log, env=child_env
        )
        router = DiscoveryRouter(process, port, log)
        try:
            await wait_until(lambda: process.returncode is not None or answers(router.url),
                             ROUTER_START_S, "router started")  # fmt: skip
            if process.returncode is not None:
                raise RuntimeError(f"router exited {process.returncode}: {router.log_text()}")
            yield router
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), ROUTER_STOP_S)
                except TimeoutError:
                    process.kill()
                    await process.wait()


async def answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            return (await http.get(url + "/liveness")).status_code == 200
    except httpx.HTTPError:
        return False
