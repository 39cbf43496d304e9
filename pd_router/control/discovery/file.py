"""Workers from a JSON manifest (``--discovery-provider file --discovery-file PATH``), read again
whenever it changes, as smg's file discovery::

    {"version": 1, "workers": [
        {"id": "p0", "url": "http://10.0.0.5:30000", "worker_type": "prefill",
         "bootstrap_port": 8998},
        {"id": "d0", "url": "http://10.0.0.6:30000", "worker_type": "decode"}
    ]}

``id`` (default: the url) names an entry; ``worker_type`` (``prefill`` or ``decode``; absent or
``regular``: the worker's live role) and ``bootstrap_port`` are optional. A listed worker joins,
a worker no longer listed leaves (its in-flight requests finish), through the same path as the
admin API. The file is read every ``check_interval_secs`` and applied when its bytes changed,
so an editor's save and an atomic swap (a Kubernetes ConfigMap volume) both count. A missing,
unreadable or invalid manifest changes nothing and is logged once until it changes; unknown
fields make it invalid (a typo must not pass for an absent field).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson

from pd_router.control.discovery.membership import DiscoveredWorker, Membership
from pd_router.control.workers import Origin, Role, normalize_url

log = logging.getLogger("pd_router.discovery")

ENTRY_FIELDS = frozenset({"id", "url", "worker_type", "bootstrap_port"})
WORKER_TYPES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "regular": None}


class ManifestError(ValueError):
    """The manifest is not what the file provider reads."""


def parse_manifest(raw: bytes) -> dict[str, DiscoveredWorker]:
    """The targets of a manifest by entry id (ManifestError naming what is wrong)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ManifestError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise ManifestError('expected {"version": 1, "workers": [...]}')
    unknown = set(data) - {"version", "workers"}
    if unknown:
        raise ManifestError(f"unknown field(s) {', '.join(sorted(unknown))}")
    if data.get("version", 1) != 1:
        raise ManifestError(f"version {data['version']!r}; this router reads version 1")
    targets: dict[str, DiscoveredWorker] = {}
    for i, entry in enumerate(data["workers"]):
        target = parse_entry(f"workers[{i}]", entry)
        entry_id = target.origin.name
        if entry_id in targets or target.url in {t.url for t in targets.values()}:
            raise ManifestError(f"workers[{i}]: {entry_id} listed twice")
        targets[entry_id] = target
    return targets


def parse_entry(where: str, entry: Any) -> DiscoveredWorker:
    if not isinstance(entry, dict):
        raise ManifestError(f"{where}: expected an object")
    unknown = set(entry) - ENTRY_FIELDS
    if unknown:
        raise ManifestError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    try:
        raw = entry.get("url")
        url = normalize_url(raw if isinstance(raw, str) else "")
    except ValueError as exc:
        raise ManifestError(f"{where}.url: {exc}") from None
    kind = entry.get("worker_type", "regular")
    if kind not in WORKER_TYPES:
        raise ManifestError(f"{where}.worker_type: prefill, decode or regular, not {kind!r}")
    port = entry.get("bootstrap_port")
    if port is not None and not (isinstance(port, int) and 0 < port < 65536):
        raise ManifestError(f"{where}.bootstrap_port: a port number, not {port!r}")
    entry_id = entry.get("id", url)
    if not isinstance(entry_id, str) or not entry_id:
        raise ManifestError(f"{where}.id: a non-empty string")
    return DiscoveredWorker(url, WORKER_TYPES[kind], port, Origin("file", entry_id))


class FileDiscovery:
    """The manifest at ``path``, read every ``interval_secs``, turned into what
    :class:`Membership` wants."""

    def __init__(self, path: str, interval_secs: float, membership: Membership) -> None:
        self._path = Path(path)
        self._interval = interval_secs
        self._membership = membership
        self._last: bytes | None = None
        self._said: str | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        log.info("reading workers from %s every %gs", self._path, self._interval)
        self.check()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.check()

    def check(self) -> None:
        """Apply the manifest if its bytes changed since the last reading."""
        try:
            raw = self._path.read_bytes()
        except OSError as exc:
            self._complain(f"cannot read discovery manifest {self._path}: {exc.strerror}")
            return
        if raw == self._last:
            return
        self._last = raw
        try:
            targets = parse_manifest(raw)
        except ManifestError as exc:
            self._complain(f"invalid discovery manifest {self._path}: {exc}; workers unchanged")
            return
        self._said = None
        for key in self._membership.keys() - set(targets):
            self._membership.want(key, None, "unlisted")
        for key, target in targets.items():
            self._membership.want(key, target)
        log.info("discovery manifest %s: %d worker(s)", self._path, len(targets))

    def _complain(self, message: str) -> None:
        if message != self._said:
            self._said = message
            log.error("%s", message)
