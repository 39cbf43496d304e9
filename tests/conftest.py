"""Shared fixtures: reference worker clusters on free loopback ports (see pd_worker.cluster).

- ``pd_cluster`` (module scope): 1 prefill + 1 decode at speed 0, role switch and faults enabled.
- ``cluster_factory`` (function scope) / ``module_cluster_factory`` (module scope):
  ``cluster_factory(prefill=2, decode=2, speed=0.0, **timing_knobs)`` starts a
  :class:`~pd_worker.cluster.WorkerCluster` and returns it; all are stopped at teardown.
- ``free_port``: a function returning a free loopback port.
- ``etcd_server`` (function scope): a real single-member etcd (see tests/etcd_helpers.py).
- ``kube_apiserver`` (module scope), ``kube`` (a fresh namespace): a real kube-apiserver (see
  tests/k8s_helpers.py).
- ``sglang_fleet`` (session scope): real SGLang servers on the CPU, a colocated reference and a
  2P2D (see tests/sglang_cluster.py).

Clusters are synchronous objects; use them from async tests as well (only their ``kill``,
``add`` and ``terminate`` calls block, briefly).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pd_worker.cluster import WorkerCluster
from pd_worker.cluster import free_port as _free_port
from tests.etcd_helpers import etcd_server  # noqa: F401 (a fixture, registered by import)
from tests.k8s_helpers import kube, kube_apiserver  # noqa: F401 (fixtures, as etcd_server)
from tests.sglang_cluster import (  # noqa: F401 (fixtures, as etcd_server)
    fleet_roles_kept,
    sglang_fleet,
)

ClusterFactory = Callable[..., WorkerCluster]

# A test run started in the background by a non-interactive shell has SIGINT ignored, and every
# process it starts would inherit that: Ctrl-C's tests send SIGINT to the CLI and expect it
# heard. A handler here (not inherited across exec) gives the processes the default again.
signal.signal(signal.SIGINT, signal.default_int_handler)


def _factory() -> Iterator[ClusterFactory]:
    clusters: list[WorkerCluster] = []

    def make(prefill: int = 1, decode: int = 1, **kwargs: Any) -> WorkerCluster:
        cluster = WorkerCluster(prefill=prefill, decode=decode, **kwargs)
        clusters.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in clusters:
            cluster.stop()


@pytest.fixture
def cluster_factory() -> Iterator[ClusterFactory]:
    yield from _factory()


@pytest.fixture(scope="module")
def module_cluster_factory() -> Iterator[ClusterFactory]:
    yield from _factory()


@pytest.fixture(scope="module")
def pd_cluster() -> Iterator[WorkerCluster]:
    with WorkerCluster(prefill=1, decode=1, speed=0.0) as cluster:
        yield cluster


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port


REAL_SGLANG_TIMEOUT_SECS = 600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The real-SGLang tests run last: their servers then share the machine with no other test
    (timing-sensitive ones included) for as long as the session keeps them. Those that kill
    servers of the shared fleet run after every other. A real-SGLang test without a timeout
    of its own gets :data:`REAL_SGLANG_TIMEOUT_SECS`: the shared fleet starts inside the first
    one's setup (162 s in a clean-clone run, 26-31 s here since its servers and their
    schedulers are forked, against the suite's 180 s)."""
    for item in items:
        if item.get_closest_marker("real_sglang") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(REAL_SGLANG_TIMEOUT_SECS))
    items.sort(
        key=lambda item: (
            item.get_closest_marker("real_sglang") is not None,
            item.get_closest_marker("ends_the_fleet") is not None,
        )
    )
