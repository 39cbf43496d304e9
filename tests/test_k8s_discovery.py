"""Kubernetes discovery on a real API server (tests/k8s_helpers.py), with real reference workers
and real router processes started from the peers' command line: pods matching the selectors
join when Ready and leave when they turn unready, are deleted or relabelled away; the live role
wins over the labels, and the labels follow conversions.

Every router here authenticates as the service account of docker/k8s/rbac.yaml with that
file's Role, so these tests also show the documented permissions are enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from pd_router.control.discovery.labels import REPAIR_AFTER_SECS
from pd_worker.cluster import LOOPBACK
from tests.conftest import ClusterFactory
from tests.etcd_helpers import EtcdServer
from tests.k8s_helpers import (
    ADMIN_TOKEN,
    ROLE_SELECTORS,
    DiscoveryRouter,
    Namespace,
    discovery_router,
    pods_for,
    router_credentials,
    worker_annotations,
    worker_pod,
)
from tests.router_helpers import fault, generate_body, wait_until
from tests.test_dashboard_page import needs_chromium, render

# How soon a pod's change must show in the router's pools (the issue's bound).
WITHIN_S = 1.0
# Long enough for any start-up or log line on a loaded machine.
LIVENESS_S = 15.0
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def discovery_args(kube: Namespace, *extra: str) -> tuple[str, ...]:
    return ("--service-discovery", "--service-discovery-namespace", kube.namespace,
            *ROLE_SELECTORS, *extra)  # fmt: skip


async def changed_within(router: DiscoveryRouter, expected: dict[str, str], bound: float) -> float:
    """Seconds until the router's pools are ``expected`` (AssertionError past ``bound``)."""
    started = time.monotonic()
    await wait_until(lambda: pools_are(router, expected), bound, f"pools {expected}")
    return time.monotonic() - started


async def pools_are(router: DiscoveryRouter, expected: dict[str, str]) -> bool:
    return await router.pools() == expected


@contextlib.asynccontextmanager
async def one_of_each(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> AsyncIterator[tuple[DiscoveryRouter, str, str]]:
    """A router discovering a prefill pod ``p0`` and a decode pod ``d0``, both in its pools;
    yields it with the two workers' urls."""
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    async with discovery_router(kubeconfig, *discovery_args(kube)) as router:
        await pods_for(kube, workers)
        await changed_within(router, {p: "prefill", d: "decode"}, LIVENESS_S)
        yield router, p, d


async def generate(router: DiscoveryRouter, prompt: str, tokens: int = 4) -> httpx.Response:
    async with router.client() as http:
        return await http.post("/generate", json=generate_body(prompt, tokens))


async def test_a_pod_turning_ready_joins_the_pool_its_labels_name_within_a_second(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    args = discovery_args(kube, "--model-id-from", "namespace")
    async with discovery_router(kubeconfig, *args) as router:
        await worker_pod(kube, "prefill-0", p, "prefill", ready=False)
        await worker_pod(kube, "decode-0", d, "decode", ready=False)
        await asyncio.sleep(0.3)
        assert await router.workers() == {}, "a pod that is not Ready does not join"
        await kube.set_status("prefill-0", ip=LOOPBACK, ready=True)
        await kube.set_status("decode-0", ip=LOOPBACK, ready=True)
        await changed_within(router, {p: "prefill", d: "decode"}, WITHIN_S)
        response = await generate(router, "joined")
        assert response.status_code == 200, response.text
        listed = (await router.workers())[p]
        assert listed["origin"] == {
            "provider": "kubernetes", "pod": "prefill-0", "namespace": kube.namespace,
            "model_id": kube.namespace,
        }  # fmt: skip
        assert await router.metric("pd_router_discovery_discovered_total") == 2


async def test_with_one_selector_the_live_role_places_each_pod(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    args = ("--service-discovery", "--service-discovery-namespace", kube.namespace,
            "--selector", "app=sglang")  # fmt: skip
    async with discovery_router(kubeconfig, *args) as router:
        for name, url in (("w0", p), ("w1", d)):
            await kube.create_pod(name, {"app": "sglang"}, worker_annotations(url))
            await kube.set_status(name, ip=LOOPBACK, ready=True)
        await changed_within(router, {p: "prefill", d: "decode"}, LIVENESS_S)
        assert "moving it to the" not in router.log_text(), "placed by the live role at once"


async def test_without_a_namespace_pods_of_every_namespace_join(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    other = f"{kube.namespace}-other"
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}}
    await kube.call("POST", "/api/v1/namespaces", body)
    app = f"sglang-{kube.namespace}"  # this test's pods only, whatever other tests left
    kubeconfig = kube.server.kubeconfig(tmp_path / "admin", ADMIN_TOKEN)
    args = ("--service-discovery", "--prefill-selector", f"app={app}", "role=prefill",
            "--decode-selector", f"app={app}", "role=decode")  # fmt: skip
    async with discovery_router(kubeconfig, *args) as router:
        for namespace, url, role in ((kube.namespace, p, "prefill"), (other, d, "decode")):
            pods = Namespace(kube.server, kube.http, namespace)
            await pods.create_pod(f"{role}-0", {"app": app, "role": role}, worker_annotations(url))
            await pods.set_status(f"{role}-0", ip=LOOPBACK, ready=True)
        await changed_within(router, {p: "prefill", d: "decode"}, LIVENESS_S)
        assert (await router.workers())[d]["origin"]["namespace"] == other


@pytest.mark.parametrize("leave", ["not_ready", "deleted", "unselected"])
async def test_a_pod_that_leaves_is_out_within_a_second_and_its_requests_finish(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path, leave: str
) -> None:
    workers = cluster_factory(prefill=1, decode=2, speed=1.0)
    (p,), (d0, d1) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    async with discovery_router(kubeconfig, *discovery_args(kube)) as router:
        await worker_pod(kube, "prefill-0", p, "prefill")
        await worker_pod(kube, "decode-0", d0, "decode")
        await changed_within(router, {p: "prefill", d0: "decode"}, LIVENESS_S)
        # ~1 s of decoding on decode-0, the only decode: it is in flight when the pod leaves.
        running = asyncio.create_task(generate(router, "in flight", tokens=100))
        await wait_until(lambda: inflight(router, d0), LIVENESS_S, "request in flight")
        await worker_pod(kube, "decode-1", d1, "decode")
        if leave == "not_ready":
            await kube.set_status("decode-0", ip=LOOPBACK, ready=False)
        elif leave == "deleted":
            await kube.delete_pod("decode-0")
        else:
            await kube.label("decode-0", app="something-else")
        await changed_within(router, {p: "prefill", d1: "decode"}, WITHIN_S)
        response = await running
        assert response.status_code == 200, response.text
        await wait_until(lambda: gone(router, d0), LIVENESS_S, "removal finished")
        # A deleted pod is seen terminating (its deletion timestamp) before it is gone.
        reason = {"deleted": "terminating"}.get(leave, leave)
        assert await router.metric("pd_router_discovery_removed_total", reason=reason) == 1


async def test_a_deleted_pod_leaves_without_an_error_or_a_new_listing(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=1, decode=2)
    (p,), (d0, d1) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    async with discovery_router(kubeconfig, *discovery_args(kube)) as router:
        await pods_for(kube, workers)
        await changed_within(router, {p: "prefill", d0: "decode", d1: "decode"}, LIVENESS_S)
        await kube.delete_pod("d1")
        await wait_until(lambda: gone(router, d1), LIVENESS_S, "d1 removed")
        # Long enough for a failed read of the deleted pod to have logged and listed again.
        await asyncio.sleep(1.0)
        log = router.log_text()
    assert " ERROR " not in log, log
    assert log.count("listed ") == 1, log


async def inflight(router: DiscoveryRouter, url: str) -> bool:
    return (await router.workers()).get(url, {}).get("inflight", 0) > 0


async def gone(router: DiscoveryRouter, url: str) -> bool:
    return url not in await router.workers()


async def test_no_request_fails_while_pods_churn_under_load(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=2, decode=2, speed=0.2)
    (p0, p1), (d0, d1) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    async with discovery_router(kubeconfig, *discovery_args(kube)) as router:
        await pods_for(kube, workers)
        everyone = {p0: "prefill", p1: "prefill", d0: "decode", d1: "decode"}
        await changed_within(router, everyone, LIVENESS_S)
        stop = asyncio.Event()
        statuses: list[int] = []

        async def load() -> None:
            async with router.client() as http:
                while not stop.is_set():
                    response = await http.post("/generate", json=generate_body("churn", 16))
                    statuses.append(response.status_code)

        clients = [asyncio.create_task(load()) for _ in range(6)]
        for _ in range(4):
            for name in ("p1", "d1"):
                await kube.set_status(name, ip=LOOPBACK, ready=False)
            await asyncio.sleep(0.3)
            for name in ("p1", "d1"):
                await kube.set_status(name, ip=LOOPBACK, ready=True)
            await changed_within(router, everyone, LIVENESS_S)
        stop.set()
        await asyncio.gather(*clients)
    assert len(statuses) > 20
    assert [s for s in statuses if s != 200] == []


async def test_an_api_server_outage_leaves_the_pools_alone_and_the_watch_resumes_after_it(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    async with one_of_each(kube, cluster_factory, tmp_path) as (router, p, d):
        kube.server.stop()
        try:
            await wait_until(lambda: "listing pods failed" in router.log_text(), LIVENESS_S)
            assert await router.pools() == {p: "prefill", d: "decode"}
            assert (await generate(router, "while the API server is away")).status_code == 200
        finally:
            await asyncio.to_thread(kube.server.start)
        await kube.set_status("d0", ip=LOOPBACK, ready=False)
        await changed_within(router, {p: "prefill"}, LIVENESS_S)


async def test_a_conversion_relabels_the_pod_and_a_restarted_router_finds_the_same_pools(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=2, decode=1)
    (p0, p1), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    await pods_for(kube, workers)
    after = {p0: "prefill", p1: "decode", d: "decode"}
    async with discovery_router(kubeconfig, *discovery_args(kube)) as router:
        await changed_within(router, {p0: "prefill", p1: "prefill", d: "decode"}, LIVENESS_S)
        async with router.client() as http:
            reply = await http.post("/convert_pd_role", json={"server_url": p1, "wait": True})
        assert reply.json()["status"] == "succeeded", reply.text
        await wait_until(lambda: labelled(kube, "p1", "decode"), WITHIN_S, "label follows")
        assert await router.metric("pd_router_discovery_label_patches_total",
                                   outcome="converted") == 1  # fmt: skip
        assert await router.pools() == after
    async with discovery_router(kubeconfig, *discovery_args(kube)) as restarted:
        await changed_within(restarted, after, LIVENESS_S)
        assert "moving it to the" not in restarted.log_text(), "labels and live roles agree"


async def labelled(kube: Namespace, pod: str, role: str) -> bool:
    return (await kube.labels(pod)).get("role") == role


async def test_a_label_changed_by_hand_to_a_wrong_role_is_repaired(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    async with one_of_each(kube, cluster_factory, tmp_path) as (router, p, d):
        await kube.label("p0", role="decode")
        await wait_until(lambda: labelled(kube, "p0", "prefill"), LIVENESS_S, "label repaired")
        assert await router.pools() == {p: "prefill", d: "decode"}, "the live role wins"
        assert "label role=decode -> prefill (repaired" in router.log_text()


async def test_a_pod_deleted_mid_drain_ends_its_conversion_cleanly(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=2, decode=1, speed=1.0)
    (p0, p1), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    async with discovery_router(
        kubeconfig, *discovery_args(kube, "--policy", "round_robin")
    ) as router:
        await pods_for(kube, workers)
        await changed_within(router, {p0: "prefill", p1: "prefill", d: "decode"}, LIVENESS_S)
        # Requests that wait on p1 before starting keep its drain waiting.
        await fault(p1, delay_secs=3.0)
        running = [asyncio.create_task(generate(router, f"long {i}")) for i in range(4)]
        await wait_until(lambda: inflight(router, p1), LIVENESS_S, "request in flight on p1")
        async with router.client() as http:
            reply = await http.post("/convert_pd_role", json={"server_url": p1, "wait": False})
            conversion = reply.json()["id"]
            await kube.delete_pod("p1")
            await wait_until(lambda: gone(router, p1), LIVENESS_S, "p1 removed")
            record = (await http.get(f"/conversions/{conversion}")).json()
        assert record["status"] == "aborted", record
        assert "because the worker is leaving" in record["message"]
        assert [r.status_code for r in await asyncio.gather(*running)] == [200] * 4
        assert await router.pools() == {p0: "prefill", d: "decode"}
        assert (await kube.labels("p0"))["role"] == "prefill"


async def test_without_patch_the_router_routes_and_converts_and_says_once_labels_cannot_be_kept(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    workers = cluster_factory(prefill=2, decode=1)
    (p0, p1), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path, verbs=("get", "list", "watch"))
    async with discovery_router(kubeconfig, *discovery_args(kube)) as router:
        await pods_for(kube, workers)
        await changed_within(router, {p0: "prefill", p1: "prefill", d: "decode"}, LIVENESS_S)
        async with router.client() as http:
            for new_role in ("decode", "prefill", "decode"):
                body = {"server_url": p1, "new_role": new_role, "wait": True}
                reply = await http.post("/convert_pd_role", json=body)
                assert reply.json()["status"] == "succeeded", reply.text
        assert (await generate(router, "still routing")).status_code == 200
        assert await router.pools() == {p0: "prefill", p1: "decode", d: "decode"}
        assert (await kube.labels("p1"))["role"] == "prefill", "nothing could patch it"
        await wait_until(
            lambda: router.metric("pd_router_discovery_label_patches_total", outcome="forbidden"),
            LIVENESS_S, "a forbidden patch counted",
        )  # fmt: skip
        assert router.log_text().count("POD LABELS CANNOT BE KEPT") == 1


async def test_two_replicas_on_etcd_see_the_same_pods_and_patch_once_per_conversion(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path, etcd_server: EtcdServer
) -> None:
    workers = cluster_factory(prefill=2, decode=1)
    (p0, p1), (d,) = workers.prefill_urls, workers.decode_urls
    kubeconfig = await router_credentials(kube, tmp_path)
    await pods_for(kube, workers)
    before = {p0: "prefill", p1: "prefill", d: "decode"}
    after = {p0: "prefill", p1: "decode", d: "decode"}
    replica = discovery_args(kube, "--etcd", etcd_server.url, "--cluster", kube.namespace)
    async with (
        discovery_router(kubeconfig, *replica, "--replica-id", "a") as a,
        discovery_router(kubeconfig, *replica, "--replica-id", "b") as b,
    ):
        for router in (a, b):
            await changed_within(router, before, LIVENESS_S)
        async with b.client() as http:
            reply = await http.post("/convert_pd_role", json={"server_url": p1, "wait": True})
        assert reply.json()["status"] == "succeeded", reply.text
        for router in (a, b):
            await changed_within(router, after, LIVENESS_S)
        await wait_until(lambda: labelled(kube, "p1", "decode"), WITHIN_S, "label follows")
        # Longer than a repair waits: a replica that saw the role before the label would have
        # patched by now.
        await asyncio.sleep(REPAIR_AFTER_SECS + 1.0)
        patches = [await r.metric("pd_router_discovery_label_patches_total") for r in (a, b)]
        assert patches == [0, 1], "only the replica that converted patches, once"


def can_mount_privately() -> bool:
    """Whether this process may give a child a mount namespace of its own."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


async def test_in_a_pod_the_router_uses_its_service_account(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    if not can_mount_privately():
        pytest.skip("needs root and unshare --mount to mount a service account directory")
    workers = cluster_factory(prefill=1, decode=1)
    (p,), (d,) = workers.prefill_urls, workers.decode_urls
    await router_credentials(kube, tmp_path)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(await kube.service_account_token("pd-router-pod"))
    shutil.copy(kube.server.ca_cert, account / "ca.crt")
    (account / "namespace").write_text(kube.namespace)
    await kube.apply({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "pd-router-pod"},
        "subjects": [{"kind": "ServiceAccount", "name": "pd-router-pod"}],
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": "pd-router-discovery"},
    })  # fmt: skip
    # The router's own mount namespace, with the account where a kubelet mounts it.
    mount = ("unshare", "--mount", "sh", "-c",
             f"mount -t tmpfs tmpfs /run && mkdir -p {SERVICE_ACCOUNT_DIR} && "
             f"cp {account}/* {SERVICE_ACCOUNT_DIR}/ && exec \"$@\"", "sh")  # fmt: skip
    host, port = kube.server.url.removeprefix("https://").rsplit(":", 1)
    env = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}
    async with discovery_router(None, *discovery_args(kube), env=env, wrap=mount) as router:
        await pods_for(kube, workers)
        await changed_within(router, {p: "prefill", d: "decode"}, LIVENESS_S)


@needs_chromium
async def test_the_dashboard_shows_each_discovered_workers_pod(
    kube: Namespace, cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    async with one_of_each(kube, cluster_factory, tmp_path) as (router, p, d):
        page = await render(router.url + "/dashboard")
    assert f"pod {kube.namespace}/p0" in page.cards[p].text
    assert f"pod {kube.namespace}/d0" in page.cards[d].text
