"""Pod role labels kept true: after a conversion, and whenever a label disagrees with the live
role.

The live role is what the worker reports (the registry holds it); a pod's role label only
proposed it. So that selectors, ``kubectl get pods -l role=prefill``, Services and a restarted
router see the role a pod really serves:

- the router whose conversion succeeded patches the pod's label at once (with replicas only the
  one that ran the conversion: one patch per conversion);
- a label that disagrees with its worker's role (changed by hand, a worker that moved outside
  any router, a patch that failed) for ``REPAIR_AFTER_SECS`` is repaired and the repair logged,
  by the replica that leads the cluster (a router alone always leads). The wait leaves the
  converting replica's own patch time to arrive.

Only pods that run one worker have a role label to keep. Without the ``patch`` permission on
pods the router still routes and converts; it says once, at error level, that labels cannot be
kept.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from pd_router.control.discovery.selectors import RoleLabel
from pd_router.control.workers import Role, UnknownWorker, Worker, WorkerRegistry, WorkerState
from pd_router.metrics import RouterMetrics

log = logging.getLogger("pd_router.discovery")

REPAIR_AFTER_SECS = 2.0
SWEEP_SECS = 0.5
# After a patch was forbidden, repairs wait this long before asking again (a conversion's own
# patch is always tried: the permission may have been granted meanwhile).
FORBIDDEN_PAUSE_SECS = 60.0
PodKey = tuple[str, str]


class PodLabels:
    """The role label of each discovered pod that runs one worker, kept equal to the role its
    worker serves."""

    def __init__(
        self,
        role_label: RoleLabel | None,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        *,
        leads: Callable[[], bool],
    ) -> None:
        self._role_label = role_label
        self._registry = registry
        self._patches = metrics.discovery_label_patches_total
        self._leads = leads
        self._api: Any = None
        # pod -> (its worker's url, its labels) for the pods that run one worker.
        self._pods: dict[PodKey, tuple[str, Mapping[str, str]]] = {}
        self._by_url: dict[str, PodKey] = {}
        self._wrong_since: dict[PodKey, float] = {}
        self._forbidden_said = False
        self._forbidden_at = -FORBIDDEN_PAUSE_SECS
        self._task: asyncio.Task[None] | None = None
        self._patching: set[asyncio.Task[None]] = set()

    def start(self, api: Any) -> None:
        self._api = api
        if self._role_label is None:
            log.info("no role label to keep: give discovery.role_label, or prefill and decode "
                     "selectors that differ in one label")  # fmt: skip
            return
        log.info("keeping pod label %r true to each worker's role", self._role_label.key)
        self._task = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._patching) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def observe(self, pod: PodKey, urls: list[str], labels: Mapping[str, str]) -> None:
        """The pod as last seen, with the urls of its workers."""
        if len(urls) != 1:
            self.forget(pod)
            return
        self._pods[pod] = (urls[0], labels)
        self._by_url[urls[0]] = pod

    def forget(self, pod: PodKey) -> None:
        entry = self._pods.pop(pod, None)
        if entry is not None and self._by_url.get(entry[0]) == pod:
            del self._by_url[entry[0]]
        self._wrong_since.pop(pod, None)

    def converted(self, worker: Worker, role: Role) -> None:
        """A conversion of this router made ``worker`` a ``role``: label its pod so now (in the
        background: the conversion's caller does not wait for the API server)."""
        pod = self._by_url.get(worker.url)
        if self._role_label is None or pod is None:
            return
        if self._pods[pod][1].get(self._role_label.key) == self._role_label.values[role]:
            return
        task = asyncio.get_running_loop().create_task(self._patch(pod, worker, role, "converted"))
        self._patching.add(task)
        task.add_done_callback(self._patching.discard)

    def _wrong(self, pod: PodKey) -> Worker | None:
        """The pod's worker when its label disagrees with the worker's settled role."""
        if self._role_label is None:
            return None
        url, labels = self._pods[pod]
        try:
            worker = self._registry.get(url)
        except UnknownWorker:
            return None
        if worker.state is not WorkerState.ACTIVE or worker.conversion_id is not None:
            return None
        wanted = self._role_label.values.get(worker.role)
        if wanted is None or labels.get(self._role_label.key) == wanted:
            return None
        return worker

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECS)
            now = time.monotonic()
            for pod in list(self._pods):
                worker = self._wrong(pod)
                if worker is None:
                    self._wrong_since.pop(pod, None)
                    continue
                since = self._wrong_since.setdefault(pod, now)
                allowed = now - self._forbidden_at >= FORBIDDEN_PAUSE_SECS
                if now - since >= REPAIR_AFTER_SECS and allowed and self._leads():
                    self._wrong_since[pod] = now
                    await self._patch(pod, worker, worker.role, "repaired")

    async def _patch(self, pod: PodKey, worker: Worker, role: Role, outcome: str) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        if self._role_label is None or pod not in self._pods:
            return
        namespace, name = pod
        key, value = self._role_label.key, self._role_label.values[role]
        old = self._pods[pod][1].get(key)
        try:
            await self._api.patch_namespaced_pod(
                name, namespace, {"metadata": {"labels": {key: value}}}
            )
        except ApiException as exc:
            if exc.status == 403:
                self._patches.labels("forbidden").inc()
                self._forbidden_at = time.monotonic()
                if not self._forbidden_said:
                    self._forbidden_said = True
                    log.error(
                        "POD LABELS CANNOT BE KEPT: the router may not patch pods (%s). Routing "
                        "and conversions go on, but %s=%s on pod %s/%s and on every pod "
                        "converted later stays wrong: grant the verb patch on pods "
                        "(docker/k8s/rbac.yaml)", exc.reason, key, old, namespace, name,
                    )  # fmt: skip
                return
            self._patches.labels("failed").inc()
            log.warning("patching pod %s/%s failed: %s %s", namespace, name, exc.status,
                        exc.reason)  # fmt: skip
            return
        except Exception as exc:
            self._patches.labels("failed").inc()
            log.warning("patching pod %s/%s failed: %s", namespace, name, exc)
            return
        self._patches.labels(outcome).inc()
        message = "pod %s/%s label %s=%s -> %s (%s)"
        level = logging.WARNING if outcome == "repaired" else logging.INFO
        log.log(level, message, namespace, name, key, old, value,
                "repaired: it disagreed with the live role" if outcome == "repaired"
                else "after its conversion",
                extra={"worker": worker.url, "pod": name, "namespace": namespace})  # fmt: skip
