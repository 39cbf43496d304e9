"""The manifests in docker/k8s/ are what a real API server accepts (a server-side dry run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.k8s_helpers import Namespace

MANIFESTS = sorted((Path(__file__).parent.parent / "docker" / "k8s").glob("*.yaml"))


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
async def test_manifest_passes_a_server_side_dry_run(kube: Namespace, path: Path) -> None:
    created = await kube.apply_file(path, dry_run=True)
    assert created, f"{path.name} holds no object"
    assert all(obj["metadata"]["namespace"] == kube.namespace for obj in created)
    pods = f"/api/v1/namespaces/{kube.namespace}/pods"
    assert (await kube.call("GET", pods))["items"] == [], "a dry run created nothing"


async def test_the_router_role_grants_pods_and_nothing_else(kube: Namespace) -> None:
    rbac = Path(__file__).parent.parent / "docker" / "k8s" / "rbac.yaml"
    created = await kube.apply_file(rbac, dry_run=True)
    role = next(obj for obj in created if obj["kind"] == "Role")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]}
    ]
