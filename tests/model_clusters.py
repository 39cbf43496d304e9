"""Two models behind one router, as the status page, ``pd-router status`` and the Grafana tests
show them: ``big`` served in PD (a prefill and two decodes) and ``small`` by two regular
workers. Each worker names its model in ``/server_info``; the router reads it from there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from pd_worker.cluster import WorkerCluster
from tests.router_helpers import RouterUnderTest, wait_until

BIG = "big"
SMALL = "small"
MODELS_READ_SECS = 10.0


def big_and_small(factory: Callable[..., WorkerCluster]) -> tuple[WorkerCluster, WorkerCluster]:
    """The two models' workers, started by a cluster ``factory`` (which stops them)."""
    big = factory(prefill=1, decode=2, extra_args=("--served-model-name", BIG))
    small = factory(prefill=0, decode=0, regular=2, extra_args=("--served-model-name", SMALL))
    return big, small


def regular_entries(cluster: WorkerCluster) -> list[dict[str, Any]]:
    """``cluster``'s regular workers as the router's ``regular`` configuration lists them."""
    return [{"url": url} for url in cluster.regular_urls]


async def wait_for_models(router: RouterUnderTest, headers: dict[str, str] | None = None) -> None:
    """Until the router has read every worker's model (it reads them on its first probes)."""

    async def read() -> bool:
        async with router.client(headers=headers) as http:
            response: httpx.Response = await http.get("/workers")
        return {w["model"] for w in response.json()["workers"]} == {BIG, SMALL}

    await wait_until(read, MODELS_READ_SECS, "every worker's model read")


def models_and_roles(big: WorkerCluster, small: WorkerCluster) -> dict[str, tuple[str, str]]:
    """Each worker's url: the model and role it serves."""
    return {
        **{url: (BIG, "prefill") for url in big.prefill_urls},
        **{url: (BIG, "decode") for url in big.decode_urls},
        **{url: (SMALL, "regular") for url in small.regular_urls},
    }
