"""Start the configured discovery provider with the router's collaborators; the router stops it
before anything else."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from pd_router.control.cluster.local import Cluster
from pd_router.control.discovery.config import DiscoveryConfig
from pd_router.control.discovery.file import FileDiscovery
from pd_router.control.discovery.kubernetes import KubernetesDiscovery, api_client
from pd_router.control.discovery.labels import PodLabels
from pd_router.control.discovery.membership import Membership
from pd_router.control.discovery.selectors import Selector, role_label
from pd_router.control.workers import Role, Worker, WorkerRegistry
from pd_router.metrics import RouterMetrics


class Discovery(Protocol):
    async def stop(self) -> None: ...


class Started:
    """A running provider and what it owns."""

    def __init__(self, provider: Discovery, membership: Membership, api: Any = None) -> None:
        self._provider = provider
        self._membership = membership
        self._api = api

    async def stop(self) -> None:
        await self._provider.stop()
        await self._membership.stop()
        if self._api is not None:
            await self._api.close()


async def start_discovery(
    config: DiscoveryConfig,
    registry: WorkerRegistry,
    cluster: Cluster,
    metrics: RouterMetrics,
    *,
    probe: Callable[[Worker], Awaitable[object]],
    remove: Callable[[Worker], Awaitable[object]],
    live_role: Callable[[str], Awaitable[Role | None]],
    let_go: Callable[[Worker], Awaitable[bool]],
    on_converted: Callable[[Callable[[Worker, Role], None]], None],
) -> Started | None:
    """Start the provider ``config`` names (None without discovery). ``on_converted`` registers
    a listener for this router's successful conversions."""
    provider = config.active_provider
    if provider is None:
        return None
    membership = Membership(
        provider, registry, cluster, metrics,
        probe=probe, remove=remove, live_role=live_role, let_go=let_go,
    )  # fmt: skip
    if provider == "file":
        files = FileDiscovery(config.file or "", config.check_interval_secs, membership)
        await files.start()
        return Started(files, membership)
    api = await api_client(config.kubeconfig)
    label = role_label(
        Selector.parse(config.prefill_selector),
        Selector.parse(config.decode_selector),
        config.role_label,
    )
    labels = PodLabels(label, registry, metrics, leads=cluster.is_leader)
    pods = KubernetesDiscovery(config, membership, labels)
    on_converted(labels.converted)
    await pods.start(api)
    return Started(pods, membership, api)
