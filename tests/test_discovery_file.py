"""File discovery (``--discovery-provider file --discovery-file PATH``): the workers of a JSON
manifest join, the ones it stops listing leave, whenever the file changes; real reference
workers and real router processes."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from tests.conftest import ClusterFactory
from tests.k8s_helpers import DiscoveryRouter, discovery_router
from tests.router_helpers import generate_body, wait_until

LIVENESS_S = 15.0


def write_manifest(path: Path, *workers: dict) -> None:
    """Replace the manifest atomically, as a ConfigMap volume does."""
    swap = path.with_suffix(".new")
    swap.write_bytes(orjson.dumps({"version": 1, "workers": list(workers)}))
    os.replace(swap, path)


def entry(url: str, worker_type: str | None = None, **extra: object) -> dict:
    return {"url": url, **({"worker_type": worker_type} if worker_type else {}), **extra}


def file_router(manifest: Path, tmp_path: Path):
    config = tmp_path / "router.toml"
    config.write_text(
        f'[discovery]\nprovider = "file"\nfile = "{manifest}"\ncheck_interval_secs = 0.1\n'
    )
    return discovery_router(None, "--config", str(config))


async def pools_are(router: DiscoveryRouter, expected: dict[str, str]) -> bool:
    return await router.pools() == expected


async def test_listed_workers_join_and_unlisted_ones_leave(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=2)
    (p,), (d0, d1) = workers.prefill_urls, workers.decode_urls
    manifest = tmp_path / "workers.json"
    write_manifest(manifest, entry(p, "prefill"), entry(d0, "decode", id="d0"))
    async with file_router(manifest, tmp_path) as router:
        await wait_until(lambda: pools_are(router, {p: "prefill", d0: "decode"}), LIVENESS_S)
        assert (await router.workers())[d0]["origin"] == {"provider": "file", "id": "d0"}
        write_manifest(manifest, entry(p, "prefill"), entry(d1))
        await wait_until(lambda: pools_are(router, {p: "prefill", d1: "decode"}), LIVENESS_S)
        async with router.client() as http:
            response = await http.post("/generate", json=generate_body("from the file"))
        assert response.status_code == 200, response.text
        assert await router.metric("pd_router_discovery_removed_total", reason="unlisted") == 1


async def test_the_live_role_wins_over_the_manifest(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    manifest = tmp_path / "workers.json"
    write_manifest(manifest, entry(p, "decode"), entry(d, "prefill"))
    async with file_router(manifest, tmp_path) as router:
        await wait_until(lambda: pools_are(router, {p: "prefill", d: "decode"}), LIVENESS_S)


async def test_a_missing_or_invalid_manifest_changes_nothing_and_says_why_once(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    manifest = tmp_path / "workers.json"
    async with file_router(manifest, tmp_path) as router:
        await wait_until(lambda: "cannot read discovery manifest" in router.log_text(), LIVENESS_S)
        write_manifest(manifest, entry(p, "prefill"), entry(d, "decode"))
        await wait_until(lambda: pools_are(router, {p: "prefill", d: "decode"}), LIVENESS_S)
        write_manifest(manifest, entry(p, "prefill"), {"url": d, "worker_typ": "decode"})
        await wait_until(lambda: "unknown field(s) worker_typ" in router.log_text(), LIVENESS_S)
        manifest.unlink()
        await wait_until(
            lambda: router.log_text().count("cannot read discovery manifest") == 2, LIVENESS_S
        )
        assert await router.pools() == {p: "prefill", d: "decode"}
        assert router.log_text().count("unknown field(s) worker_typ") == 1


async def test_a_manifest_that_empties_a_pool_says_so_in_a_warning(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=2)
    (p,), (d0, d1) = workers.prefill_urls, workers.decode_urls
    manifest = tmp_path / "workers.json"
    write_manifest(manifest, entry(p, "prefill"), entry(d0, "decode"), entry(d1, "decode"))
    async with file_router(manifest, tmp_path) as router:
        both = {p: "prefill", d0: "decode", d1: "decode"}
        await wait_until(lambda: pools_are(router, both), LIVENESS_S)
        write_manifest(manifest, entry(p, "prefill"), entry(d1, "decode"))
        await wait_until(lambda: pools_are(router, {p: "prefill", d1: "decode"}), LIVENESS_S)
        write_manifest(manifest, entry(p, "prefill"))
        await wait_until(lambda: pools_are(router, {p: "prefill"}), LIVENESS_S)
        log = router.log_text()
    emptied = f"{d1} leaves: unlisted; no healthy decode worker is left"
    assert f"WARNING pd_router.discovery: {emptied}" in log, log
    assert f"INFO pd_router.discovery: {d0} leaves: unlisted" in log, log
