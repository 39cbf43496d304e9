"""The fixture pair of the router test modules that inject faults into reference workers: one
cluster for the whole module, and every fault cleared after each test, so that a test's fault
never reaches the tests after it on the same workers.

A module names its cluster's shape and imports the autouse clearing fixture::

    from tests.fault_cluster import clear_faults, module_cluster  # noqa: F401 (fixtures)

    cluster = module_cluster(prefill=2, decode=2, speed=0.0)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pd_worker.cluster import WorkerCluster
from tests.router_helpers import fault


def module_cluster(prefill: int, decode: int, **knobs: Any) -> Callable[..., WorkerCluster]:
    """A module-scoped ``cluster`` fixture: ``prefill`` and ``decode`` reference workers started
    with ``knobs`` (speed, timing), stopped when the module's tests are done."""

    @pytest.fixture(scope="module", name="cluster")
    def cluster(module_cluster_factory: Callable[..., WorkerCluster]) -> WorkerCluster:
        return module_cluster_factory(prefill=prefill, decode=decode, **knobs)

    return cluster


@pytest.fixture(autouse=True)
async def clear_faults(cluster: WorkerCluster) -> AsyncIterator[None]:
    """After each test: no fault left on any worker of the module's cluster."""
    yield
    for url in cluster.urls:
        await fault(url, clear=True)
