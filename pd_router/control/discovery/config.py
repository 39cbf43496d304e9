"""The ``[discovery]`` section: where workers come from besides the command line.

The peers' flags set it (``--service-discovery``, ``--discovery-provider``, ``--selector``,
``--prefill-selector``, ``--decode-selector``, ``--service-discovery-port``,
``--service-discovery-namespace``, ``--model-id-from``, ``--discovery-file``,
``--discovery-check-interval-secs``); ``role_label`` and ``kubeconfig`` are pd-router's own.
"""

from __future__ import annotations

from dataclasses import dataclass

PROVIDERS = ("kubernetes", "file")


class DiscoveryUnavailable(RuntimeError):
    """Discovery cannot start: no credentials for the Kubernetes API, or kubernetes_asyncio is
    not installed. The router does not serve."""


@dataclass(frozen=True)
class DiscoveryConfig:
    # --service-discovery: discover workers (from Kubernetes unless ``provider`` says otherwise).
    enabled: bool = False
    # "kubernetes" or "file"; setting it alone turns discovery on.
    provider: str | None = None
    # The file provider's JSON manifest, and how often it is read for changes.
    file: str | None = None
    check_interval_secs: float = 1.0
    # Label selectors (``key=value`` items, or kubectl's comma-separated form).
    selector: tuple[str, ...] = ()
    prefill_selector: tuple[str, ...] = ()
    decode_selector: tuple[str, ...] = ()
    # The workers' port (a pod's smg.ai/worker-ports annotation lists its own).
    port: int = 80
    # Namespace watched; unset: every namespace (needs a ClusterRole).
    namespace: str | None = None
    # namespace, label:KEY or annotation:KEY: the model id shown with each worker.
    model_id_from: str | None = None
    # The pod label kept equal to each worker's live role; unset: the one label the prefill and
    # decode selectors give different values.
    role_label: str | None = None
    # A kubeconfig file; unset: $KUBECONFIG or ~/.kube/config when present, else the pod's
    # service account.
    kubeconfig: str | None = None

    @property
    def active_provider(self) -> str | None:
        """The provider in use, None without discovery."""
        if self.provider:
            return self.provider
        return "kubernetes" if self.enabled else None
