"""A worker's own record in etcd, kept under a lease: the record goes when the worker does.

This is the pattern Dynamo's workers follow: a worker grants itself a lease, puts
``workers/<url>`` (a :class:`~pd_protocol.cluster.WorkerRecord` with ``source="self"``) under it
and refreshes the lease every ``ttl / 3`` seconds. A worker that is killed stops refreshing and
etcd deletes its record within ``ttl``; a graceful shutdown revokes the lease, which deletes the
record at once. Router replicas watching ``workers/`` add and drop the worker accordingly.

A router that changes the record (a conversion) puts it back under the same lease, so the record
stays tied to the worker's life, and the refreshes keep it alive as changed. The record is only
written again when the lease is lost (etcd restarted after it expired, or it was revoked): then
the live role and bootstrap port come from ``current()``, the fields a router manages (state,
conversion) are kept, and the epoch is kept, or bumped when the live role differs from the
stored one.

While etcd is unreachable or stalls, the refresh loop retries well within the TTL (a short
outage costs nothing) and logs one warning; the worker keeps serving throughout. Once the lease
may have expired (one TTL after the last refresh that etcd took), the next call to reach etcd
grants a new lease and moves the record onto it, so the record is usually back before etcd has
even deleted it; :meth:`SelfRegistration.stats` says how long the worker went unregistered. A
graceful stop marks the record ``removing`` before it revokes the lease, so routers take the
worker out of their pools at once rather than waiting out the grace period they give a record
that goes without a word.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import aiohttp

from pd_protocol.backoff import Backoff
from pd_protocol.cluster import (
    DEFAULT_LEASE_TTL_SECS,
    DEFAULT_PREFIX,
    BadRecord,
    ClusterKeys,
    WorkerRecord,
    record_role,
)
from pd_protocol.etcd_client import (
    GRPC_NOT_FOUND,
    EtcdClient,
    EtcdError,
    EtcdRequestError,
    EtcdUnavailable,
    KeyValue,
    LeaseNotFound,
    if_absent,
    if_unchanged,
    put_op,
)

logger = logging.getLogger(__name__)

RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 0.5
PUT_ATTEMPTS = 5
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

T = TypeVar("T")
CurrentRole = Callable[[], tuple[str, int | None]]


def advertise_url(scheme: str, host: str, port: int) -> str:
    """The url routers reach a worker at: a wildcard listen address is no address to reach, so
    it is replaced by this machine's host name (pass an explicit advertise url behind NAT)."""
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def registered_record(
    url: str, role: str, bootstrap_port: int | None, stored: WorkerRecord | None
) -> WorkerRecord:
    """The record a worker puts for itself, given what is stored for its url now (if anything).

    A stored record may carry a router's conversion state: it is kept, with the live role and
    bootstrap port put in; the epoch counts role changes, so it moves on when the live role is
    not the stored one. A regular server's live role, SGLang's ``null``, is put as ``regular``.
    """
    role = record_role(role)
    if stored is None:
        return WorkerRecord(url=url, role=role, bootstrap_port=bootstrap_port, source="self")
    if stored.state == "removing":
        # A removal that ended with the worker still serving (or a stop that could not revoke
        # its lease): the worker registers afresh, keeping only the epoch.
        stored = stored.evolve(state="active", conversion=None, owner=None, to_role=None)
    return stored.in_role(role, bootstrap_port).evolve(source="self")


@dataclass(frozen=True)
class RegistrationStats:
    """How a registration fared: whether its lease is alive as far as the worker knows (renewed
    within its TTL), how often it lapsed, and for how long in all the worker went without a
    registration (from the moment its lease could have expired to the record being put again;
    the current gap included)."""

    registered: bool
    lapses: int
    unregistered_secs: float


@dataclass(frozen=True)
class FlagNames:
    """How a launcher spells the registration flags, for its usage errors."""

    etcd: str
    cluster: str
    advertise_url: str


@dataclass(frozen=True)
class RegistrationSettings:
    """Where a worker registers itself: the ``--etcd`` family of launch flags, shared by
    ``pd-worker serve`` and the SGLang launcher. ``advertise_url`` None: the server's own url."""

    endpoints: tuple[str, ...]
    cluster: str
    prefix: str = DEFAULT_PREFIX
    advertise_url: str | None = None
    lease_ttl: int = DEFAULT_LEASE_TTL_SECS

    def validate(self) -> None:
        """Raise ValueError with a one-line reason for settings that cannot work."""
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        for url in (*self.endpoints, *((self.advertise_url,) if self.advertise_url else ())):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"{url!r} is not an http(s)://host:port url")
        if not self.cluster or "/" in self.cluster:
            raise ValueError(
                f"the cluster name must be non-empty without '/', got {self.cluster!r}"
            )
        if self.lease_ttl < 1:
            raise ValueError(f"the etcd lease ttl must be at least 1 second, got {self.lease_ttl}")

    @classmethod
    def from_flags(
        cls,
        flags: FlagNames,
        endpoints: list[str],
        cluster: str | None,
        prefix: str,
        advertise_url: str | None,
        lease_ttl: int,
    ) -> RegistrationSettings | None:
        """The settings a launcher's flags give (None without an etcd endpoint); ValueError
        naming the launcher's flags when they cannot work together."""
        if not endpoints:
            if cluster is not None or advertise_url is not None:
                raise ValueError(f"{flags.cluster} and {flags.advertise_url} need {flags.etcd} URL")
            return None
        if cluster is None:
            raise ValueError(f"{flags.etcd} needs {flags.cluster} NAME (the router cluster)")
        settings = cls(tuple(endpoints), cluster, prefix, advertise_url, lease_ttl)
        settings.validate()
        return settings

    def registration(
        self, session: aiohttp.ClientSession, own_url: str, current: CurrentRole
    ) -> SelfRegistration:
        """The registration of this server, at ``advertise_url`` or else at ``own_url``."""
        return SelfRegistration(
            session,
            list(self.endpoints),
            ClusterKeys(self.cluster, self.prefix),
            (self.advertise_url or own_url).rstrip("/"),
            current,
            self.lease_ttl,
        )


class RegistrationConflict(EtcdError):
    """The record kept changing under every compare-and-swap attempt."""


class SelfRegistration:
    """Keep ``workers/<url>`` of cluster ``keys`` in etcd while this worker lives.

    ``endpoints`` are tried in order: the first that answers is used until it stops answering
    (EtcdUnavailable), then the next. ``current()`` returns the worker's live (role,
    bootstrap_port) and is read whenever the record is written.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoints: list[str],
        keys: ClusterKeys,
        url: str,
        current: CurrentRole,
        ttl: int = DEFAULT_LEASE_TTL_SECS,
    ) -> None:
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        if ttl < 1:
            raise ValueError(f"the lease ttl must be at least 1 second, got {ttl}")
        # A call that hangs must not outlast the refresh interval by much, or the lease expires
        # while the worker waits on one endpoint instead of trying the next.
        timeout = max(1.0, ttl / 3)
        self._clients = [EtcdClient(session, endpoint, timeout=timeout) for endpoint in endpoints]
        self._endpoints = list(endpoints)
        self._active = 0
        self._keys = keys
        self._url = url
        self._current = current
        self._ttl = ttl
        self._lease: int | None = None
        # When the call that last granted or refreshed the lease was sent: etcd counts the TTL
        # from a moment after it, so the lease lives at least until one TTL after this.
        self._renewed_at = 0.0
        # Whether the record was put under the current lease (a grant may succeed and the put
        # fail: the next attempt puts it under the same lease).
        self._registered = False
        # The record last put: what is put again when etcd lost it (its epoch goes on).
        self._last: WorkerRecord | None = None
        self._unregistered_since: float | None = None
        self._unregistered_secs = 0.0
        self._lapses = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def key(self) -> str:
        return self._keys.worker(self._url)

    @property
    def lease_id(self) -> int | None:
        """The lease the record is held under now (None before the first grant and after stop)."""
        return self._lease

    @property
    def refresh_interval(self) -> float:
        return self._ttl / 3

    def stats(self) -> RegistrationStats:
        now = time.monotonic()
        gap = 0.0 if self._unregistered_since is None else now - self._unregistered_since
        return RegistrationStats(
            registered=self._registered and not self._lapsed(now),
            lapses=self._lapses,
            unregistered_secs=self._unregistered_secs + gap,
        )

    def _lapsed(self, now: float) -> bool:
        """Whether the lease may have expired: no refresh etcd took for one TTL."""
        return self._lease is not None and now >= self._renewed_at + self._ttl

    def _lapse(self, gone: bool) -> None:
        """The lease expired (``gone``: etcd said so) or may have: register again, counting
        the time without a registration from the moment it could have expired."""
        if self._registered:
            self._lapses += 1
            self._unregistered_since = min(time.monotonic(), self._renewed_at + self._ttl)
        self._registered = False
        if gone:
            self._lease = None

    async def start(self) -> None:
        """Register now and keep the registration alive in a background task.

        When etcd does not answer (or refuses) yet, the worker still starts: one warning is
        logged and the background task registers as soon as etcd answers.
        """
        if self._task is not None:
            return
        registered = True
        try:
            await self._register()
        except EtcdError as exc:
            registered = False
            self._unregistered_since = time.monotonic()
            logger.warning(
                "%s could not register in etcd yet (%s): it serves and registers once etcd answers",
                self._url,
                exc,
            )
        self._task = asyncio.create_task(
            self._keep_alive(failing=not registered), name=f"registration {self._url}"
        )

    async def stop(self) -> None:
        """Stop refreshing and revoke the lease, so the record goes at once. Safe to call again
        and when etcd is down (the record then goes when the lease expires)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        registered = self._registered
        lease, self._lease, self._registered = self._lease, None, False
        if lease is None:
            return
        try:
            if registered:
                await self._announce_leaving(lease)
            await self._call(lambda client: client.revoke_lease(lease))
        except LeaseNotFound:
            pass
        except EtcdError as exc:
            logger.warning(
                "could not revoke lease %x of %s (%s): the record goes within %ds",
                lease,
                self._url,
                exc,
                self._ttl,
            )
        else:
            logger.info("%s unregistered from etcd", self._url)

    async def _keep_alive(self, failing: bool) -> None:
        """Refresh the lease every ttl/3; register again when it is lost or may have expired;
        ride out outages, retrying well within the TTL (``failing``: the outage began before
        this loop, and was logged already)."""
        pause = Backoff(RETRY_INITIAL_S, min(RETRY_MAX_S, self.refresh_interval))
        unreachable = failing
        while True:
            if self._registered and self._lapsed(time.monotonic()):
                self._lapse(gone=False)
            try:
                if self._registered and self._lease is not None:
                    await self._refresh(self._lease)
                else:
                    await self._register()
            except LeaseNotFound:
                logger.info("lease of %s is gone: registering again", self._url)
                self._lapse(gone=True)
                await asyncio.sleep(RETRY_INITIAL_S)
                continue
            except EtcdError as exc:
                if not unreachable:
                    logger.warning(
                        "etcd call failed (%s): %s keeps serving and retries; its record is "
                        "put again if its lease expires meanwhile",
                        exc,
                        self._url,
                    )
                    unreachable = True
                await pause.sleep()
                continue
            if unreachable:
                logger.info("etcd answers again: %s is registered", self._url)
                unreachable = False
            pause.reset()
            await asyncio.sleep(self.refresh_interval)

    async def _refresh(self, lease: int) -> None:
        sent = time.monotonic()
        await self._call(lambda client: client.keepalive(lease))
        self._renewed_at = sent

    async def _register(self) -> None:
        """Put the record under this worker's lease (a new one when there is none or the last
        may have expired), as a compare-and-swap against what is stored, so a router's
        concurrent change is not lost. A record still held by the old lease moves onto the new
        one, and the old lease's expiry then deletes nothing."""
        if self._lease is None or self._lapsed(time.monotonic()):
            sent = time.monotonic()
            lease = await self._call(lambda client: client.grant_lease(self._ttl))
            self._lease, self._renewed_at = lease.id, sent
        lease_id = self._lease
        for _ in range(PUT_ATTEMPTS):
            stored = await self._call(lambda client: client.get(self.key))
            role, bootstrap_port = self._current()
            record = registered_record(
                self._url, role, bootstrap_port, _decoded(stored) or self._last
            )
            if await self._put(record, stored, lease_id):
                self._registered, self._last = True, record
                self._registered_again()
                logger.info(
                    "%s registered in etcd as %s (bootstrap port %s, lease %x)",
                    self._url,
                    role,
                    bootstrap_port,
                    lease_id,
                )
                return
        raise RegistrationConflict(f"{self.key} changed under {PUT_ATTEMPTS} attempts to put it")

    def _registered_again(self) -> None:
        if self._unregistered_since is None:
            return
        gap = time.monotonic() - self._unregistered_since
        self._unregistered_since = None
        self._unregistered_secs += gap
        logger.info("%s registered again after %.1fs unregistered", self._url, gap)

    async def _announce_leaving(self, lease: int) -> None:
        """Mark the record ``removing`` (if it is still this worker's), so routers stop
        sending to the worker now instead of taking the record's going for a lapse."""
        stored = await self._call(lambda client: client.get(self.key))
        record = _decoded(stored)
        if stored is None or record is None or stored.lease != lease:
            return
        leaving = record.evolve(state="removing").encode()
        revision = stored.mod_revision
        try:
            await self._call(
                lambda client: client.txn(
                    [if_unchanged(self.key, revision)], [put_op(self.key, leaving, lease=lease)]
                )
            )
        except EtcdRequestError as exc:
            # The lease went meanwhile (the record with it): nothing left to mark.
            logger.info("%s not marked as leaving: %s", self._url, exc)

    async def _put(self, record: WorkerRecord, stored: KeyValue | None, lease: int) -> bool:
        """Whether the compare-and-swap put held; LeaseNotFound when the lease is gone."""
        value = record.encode()
        compare = (
            if_absent(self.key) if stored is None else if_unchanged(self.key, stored.mod_revision)
        )
        try:
            result = await self._call(
                lambda client: client.txn([compare], [put_op(self.key, value, lease=lease)])
            )
        except EtcdRequestError as exc:
            if exc.code == GRPC_NOT_FOUND:
                raise LeaseNotFound(lease) from exc
            raise
        return result.succeeded

    async def _call(self, call: Callable[[EtcdClient], Awaitable[T]]) -> T:
        """``call`` on the endpoint in use, moving on to the next ones while they are down."""
        failure: EtcdUnavailable | None = None
        for step in range(len(self._clients)):
            index = (self._active + step) % len(self._clients)
            try:
                result = await call(self._clients[index])
            except EtcdUnavailable as exc:
                failure = exc
                continue
            if index != self._active:
                logger.info("etcd endpoint %s answers: using it", self._endpoints[index])
                self._active = index
            return result
        raise EtcdUnavailable(f"no etcd endpoint answers ({failure})")


def _decoded(stored: KeyValue | None) -> WorkerRecord | None:
    """The stored record, or None when there is none or it is not a worker record (replaced)."""
    if stored is None:
        return None
    try:
        return WorkerRecord.decode(stored.value)
    except BadRecord:
        logger.warning("replacing %s: not a worker record", stored.key)
        return None
