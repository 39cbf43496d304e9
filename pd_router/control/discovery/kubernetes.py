"""Workers from the Kubernetes API, as smg discovers them: pods that match the selectors and are
Running and Ready (a pod IP, the Ready condition true, not terminating) join at
``http://POD_IP:PORT``; a pod that turns unready, starts terminating, is deleted or stops
matching leaves (:mod:`.membership`: its in-flight requests finish).

- ``selector`` must match every worker pod; ``prefill_selector``/``decode_selector`` (when
  given, a pod must match one) propose its role. The live role wins: a pod labelled prefill
  that serves decode is a decode worker, and its label is repaired (:mod:`.labels`).
- The port is ``port`` (``--service-discovery-port``, default 80), or one worker per port listed
  in the pod's ``smg.ai/worker-ports`` annotation (``"8000,8001"``). A prefill's bootstrap port
  is what its worker reports, as for configured workers; the ``sglang.ai/bootstrap-port``
  annotation (one port, or one per worker port) gives it until then.
- ``model_id_from``: ``namespace``, ``label:KEY`` or ``annotation:KEY``, shown with the worker.
- One list and watch of the pods in ``namespace`` (all namespaces when unset) with the
  requirements the selectors share, so a pod whose role label is patched moves from the prefill
  to the decode selector in one event. A watch that ends is resumed from its last version; one
  that is too old, or any error, lists again (with a growing pause after errors).

Credentials: ``kubeconfig`` (or ``$KUBECONFIG``, ``~/.kube/config``) when given or present,
otherwise the pod's service account (in-cluster). ``kubernetes_asyncio`` (the ``k8s`` extra) is
imported only here, when this provider starts.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pd_protocol.backoff import Backoff
from pd_router.control.discovery.config import DiscoveryConfig, DiscoveryUnavailable
from pd_router.control.discovery.labels import PodLabels
from pd_router.control.discovery.membership import DiscoveredWorker, Membership
from pd_router.control.discovery.selectors import Selector, shared
from pd_router.control.workers import Origin, Role

log = logging.getLogger("pd_router.discovery")

PORTS_ANNOTATION = "smg.ai/worker-ports"
BOOTSTRAP_ANNOTATION = "sglang.ai/bootstrap-port"
WATCH_TIMEOUT_SECS = 240
RETRY_MIN_SECS = 0.5
RETRY_MAX_SECS = 15.0
NOT_INSTALLED = "Kubernetes discovery needs kubernetes_asyncio: pip install 'pd-router[k8s]'"


async def api_client(kubeconfig: str | None) -> Any:
    """An ApiClient from ``kubeconfig`` (or the default kubeconfig when one exists), else from
    the pod's service account."""
    try:
        from kubernetes_asyncio import client, config
    except ImportError as exc:
        raise DiscoveryUnavailable(NOT_INSTALLED) from exc
    configuration = client.Configuration()
    path = kubeconfig_path(kubeconfig)
    try:
        if path is not None:
            await config.load_kube_config(config_file=path, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException as exc:
        raise DiscoveryUnavailable(no_credentials(path, str(exc).rstrip("."))) from exc
    return client.ApiClient(configuration)


def check_credentials(kubeconfig: str | None) -> None:
    """Before the router starts: DiscoveryUnavailable when kubernetes_asyncio is missing or no
    credentials can be there at all (no kubeconfig file, not in a pod), so the mistake is one
    line at start-up; the client reads them for real when discovery starts."""
    if importlib.util.find_spec("kubernetes_asyncio") is None:
        raise DiscoveryUnavailable(NOT_INSTALLED)
    path = kubeconfig_path(kubeconfig)
    if path is not None and not Path(path).is_file():
        raise DiscoveryUnavailable(no_credentials(path, "no such file"))
    if path is None and "KUBERNETES_SERVICE_HOST" not in os.environ:
        raise DiscoveryUnavailable(no_credentials(None, "KUBERNETES_SERVICE_HOST is not set"))


def no_credentials(path: str | None, error: str) -> str:
    """Why no credentials were found, naming every place looked at."""
    if path is not None:
        return f"no Kubernetes credentials in the kubeconfig {path}: {error}"
    kubeconfig = os.environ.get("KUBECONFIG")
    looked = f"$KUBECONFIG ({kubeconfig})" if kubeconfig else "$KUBECONFIG (unset), ~/.kube/config"
    if "KUBERNETES_SERVICE_HOST" in os.environ:
        return f"no Kubernetes credentials: the pod's service account: {error}"
    return (
        f"no Kubernetes credentials: no kubeconfig at {looked}, and not in a pod for a service "
        f"account ({error}); set $KUBECONFIG or [discovery] kubeconfig"
    )


def kubeconfig_path(given: str | None) -> str | None:
    """The kubeconfig to use: the one given, else $KUBECONFIG or ~/.kube/config when it exists
    outside a pod; None: the pod's service account."""
    if given:
        return given
    path = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    in_pod = "KUBERNETES_SERVICE_HOST" in os.environ
    return path if not in_pod and Path(path).exists() else None


class KubernetesDiscovery:
    """The list and watch of the worker pods, turned into what :class:`Membership` wants."""

    def __init__(self, config: DiscoveryConfig, membership: Membership, labels: PodLabels) -> None:
        self._config = config
        self._membership = membership
        self._labels = labels
        self._selector = Selector.parse(config.selector)
        self._prefill = Selector.parse(config.prefill_selector)
        self._decode = Selector.parse(config.decode_selector)
        roles = [s for s in (self._prefill, self._decode) if s]
        self._watched = Selector(
            (*self._selector.requirements, *shared(roles).requirements)
            if roles
            else self._selector.requirements
        )
        self._keys: dict[tuple[str, str], set[str]] = {}
        self._api: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, api: Any) -> None:
        from kubernetes_asyncio import client

        self._api = client.CoreV1Api(api)
        self._labels.start(self._api)
        where = self._config.namespace or "all namespaces"
        log.info("watching pods in %s with selector %r", where, str(self._watched))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._labels.stop()

    # --- list and watch ---------------------------------------------------------------------

    async def _run(self) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        backoff = Backoff(RETRY_MIN_SECS, RETRY_MAX_SECS)
        while True:
            try:
                await self._list_and_watch()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    continue
                log.error("listing pods failed (%s %s); again in %.1fs", exc.status, exc.reason,
                          backoff.secs)  # fmt: skip
            except Exception as exc:
                log.error("listing pods failed (%s); again in %.1fs", exc, backoff.secs)
            await backoff.sleep()

    def _list_call(self) -> tuple[Any, tuple[Any, ...]]:
        if self._config.namespace:
            return self._api.list_namespaced_pod, (self._config.namespace,)
        return self._api.list_pod_for_all_namespaces, ()

    async def _list_and_watch(self) -> None:
        from kubernetes_asyncio import watch

        call, args = self._list_call()
        selector = str(self._watched) or None
        listing = await body_of(await call(*args, label_selector=selector, _preload_content=False))
        pods = listing.get("items") or ()
        log.info("listed %d pod(s); watching for changes", len(pods))
        present = set()
        for pod in pods:
            present.add(self._apply(pod))
        for pod_key in set(self._keys) - present:
            self._gone(pod_key, "deleted")
        version = listing["metadata"]["resourceVersion"]
        while True:
            stream = watch.Watch().stream(
                call, *args, label_selector=selector, resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_SECS, allow_watch_bookmarks=True,
            )  # fmt: skip
            async with stream:
                async for event in stream:
                    pod = event["raw_object"]
                    version = pod["metadata"].get("resourceVersion", version)
                    if event["type"] == "DELETED":
                        await self._deleted(pod)
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._apply(pod)

    # --- one pod ----------------------------------------------------------------------------

    def _apply(self, pod: Mapping[str, Any]) -> tuple[str, str]:
        """Want the workers of ``pod`` as it is now; returns its key."""
        pod_key = pod_key_of(pod)
        metadata = pod["metadata"]
        labels = metadata.get("labels") or {}
        selected, role = self._propose(labels)
        ready, why = readiness(pod)
        targets: dict[str, DiscoveredWorker] = {}
        if selected and ready:
            origin = Origin(
                "kubernetes", metadata["name"], metadata.get("namespace"), self._model_id(pod)
            )
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            for port, bootstrap in worker_ports(pod, self._config.port):
                targets[f"{pod_key[0]}/{pod_key[1]}:{port}"] = DiscoveredWorker(
                    f"http://{host}:{port}", role, bootstrap, origin
                )
        reason = why if selected else "unselected"
        for key in self._keys.get(pod_key, set()) - set(targets):
            self._membership.want(key, None, reason)
        for key, target in targets.items():
            self._membership.want(key, target)
        if targets:
            self._keys[pod_key] = set(targets)
            self._labels.observe(pod_key, [t.url for t in targets.values()], labels)
        else:
            self._keys.pop(pod_key, None)
            self._labels.forget(pod_key)
        return pod_key

    def _gone(self, pod_key: tuple[str, str], reason: str) -> None:
        for key in self._keys.pop(pod_key, set()):
            self._membership.want(key, None, reason)
        self._labels.forget(pod_key)

    async def _deleted(self, pod: Mapping[str, Any]) -> None:
        """A pod left the watch: deleted, or relabelled so that the watch's selector no longer
        matches it. The API server reports both as a deletion of the pod as it was; reading the
        pod tells which."""
        namespace, name = pod_key_of(pod)
        response = await self._api.read_namespaced_pod(name, namespace, _preload_content=False)
        if response.status == 404:
            response.release()
            self._gone((namespace, name), "deleted")
            return
        self._apply(await body_of(response))

    def _propose(self, labels: Mapping[str, str]) -> tuple[bool, Role | None]:
        """Whether a pod with ``labels`` is a worker, and the role its labels propose."""
        if self._selector and not self._selector.matches(labels):
            return False, None
        if self._prefill and self._prefill.matches(labels):
            return True, Role.PREFILL
        if self._decode and self._decode.matches(labels):
            return True, Role.DECODE
        return not (self._prefill or self._decode), None

    def _model_id(self, pod: Mapping[str, Any]) -> str | None:
        source = self._config.model_id_from
        if not source:
            return None
        metadata = pod["metadata"]
        if source == "namespace":
            return metadata.get("namespace")
        kind, _, key = source.partition(":")
        table = metadata.get("labels" if kind == "label" else "annotations") or {}
        return table.get(key)


async def body_of(response: Any) -> dict[str, Any]:
    """The JSON body of a call made with ``_preload_content=False`` (the raw dicts, without the
    client's model objects), which does not raise on an error status as the client's other
    calls do: ApiException then, so a ``Status`` body is never read as a pod or a list."""
    from kubernetes_asyncio.client.exceptions import ApiException

    if not 200 <= response.status < 300:
        reason = await response.text()
        raise ApiException(status=response.status, reason=f"{response.reason}: {reason[:200]}")
    return await response.json()


def pod_key_of(pod: Mapping[str, Any]) -> tuple[str, str]:
    metadata = pod["metadata"]
    return metadata.get("namespace") or "", metadata["name"]


def readiness(pod: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the pod takes traffic (as a Service endpoint would), else why not."""
    if pod["metadata"].get("deletionTimestamp"):
        return False, "terminating"
    status = pod.get("status") or {}
    if not status.get("podIP") or status.get("phase") != "Running":
        return False, "not_running"
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready":
            return condition.get("status") == "True", "not_ready"
    return False, "not_ready"


def worker_ports(pod: Mapping[str, Any], default: int) -> list[tuple[int, int | None]]:
    """(port, bootstrap port) of each worker the pod runs: the ports of its
    ``smg.ai/worker-ports`` annotation (the default port when absent or invalid), the
    bootstrap ports of its ``sglang.ai/bootstrap-port`` annotation (one for all, or one each)."""
    annotations = pod["metadata"].get("annotations") or {}
    name = pod["metadata"]["name"]
    ports = port_list(annotations.get(PORTS_ANNOTATION), PORTS_ANNOTATION, name) or [default]
    bootstraps = port_list(annotations.get(BOOTSTRAP_ANNOTATION), BOOTSTRAP_ANNOTATION, name)
    if len(bootstraps) == 1:
        bootstraps *= len(ports)
    if bootstraps and len(bootstraps) != len(ports):
        log.warning("pod %s: %s lists %d ports for %d workers; reading them from the workers",
                    name, BOOTSTRAP_ANNOTATION, len(bootstraps), len(ports))  # fmt: skip
        bootstraps = []
    if not bootstraps:
        return [(port, None) for port in ports]
    return list(zip(ports, bootstraps, strict=True))


def port_list(value: str | None, annotation: str, pod: str) -> list[int]:
    if not value:
        return []
    try:
        ports = list(dict.fromkeys(int(p) for p in value.split(",")))
    except ValueError:
        ports = []
    if not ports or not all(0 < p < 65536 for p in ports):
        log.warning("pod %s: invalid %s annotation %r", pod, annotation, value)
        return []
    return ports
