"""An asyncio client for etcd's v3 JSON gateway, over the caller's aiohttp session.

Router replicas coordinate through etcd; its gRPC-gateway speaks HTTP/JSON, so the router's own
aiohttp session suffices and no gRPC stack joins the runtime dependencies. In that API keys and
values are base64 and 64-bit integers are JSON strings, omitted when zero; this module hides both.
The gateway prefix is ``/v3/`` (etcd 3.4 and later).

Failures are specific exceptions: :class:`EtcdUnavailable` when etcd cannot be reached or answer
in time (callers keep their last state and retry), :class:`EtcdRequestError` when etcd refused a
request (with etcd's gRPC code), :class:`LeaseNotFound` for an expired or revoked lease and
:class:`WatchCompacted` when a watch cannot resume because its revision was compacted away.
"""

from __future__ import annotations

import asyncio
import base64
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pd_protocol.backoff import Backoff

DEFAULT_TIMEOUT_S = 5.0
GRPC_NOT_FOUND = 5
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_UNAVAILABLE = 14
WATCH_RETRY_INITIAL_S = 0.05
WATCH_RETRY_MAX_S = 1.0
WATCH_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class EtcdError(Exception):
    """Base class of every error this client raises."""


class EtcdUnavailable(EtcdError):
    """etcd could not be reached, dropped the connection or did not answer in time."""


class EtcdRequestError(EtcdError):
    """etcd answered with an error; ``code`` is its gRPC status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd error {code}: {message}")
        self.code = code
        self.message = message


class LeaseNotFound(EtcdError):
    """The lease expired or was revoked, so keys attached to it are gone."""

    def __init__(self, lease_id: int) -> None:
        super().__init__(f"etcd lease {lease_id} not found")
        self.lease_id = lease_id


class WatchCompacted(EtcdError):
    """A watch could not start or resume at its revision: etcd compacted history up to here."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"etcd history compacted up to revision {compact_revision}")
        self.compact_revision = compact_revision


@dataclass(frozen=True)
class KeyValue:
    """One stored key: revisions let callers compare-and-swap and resume watches."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class TxnResult:
    """Whether a transaction's compares held, and the store's revision after it (the
    ``mod_revision`` of every key it wrote, when they held)."""

    succeeded: bool
    revision: int


class EventType(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True)
class WatchEvent:
    """A change to a watched key; a DELETE carries the key and the deleting revision only."""

    type: EventType
    kv: KeyValue


@dataclass(frozen=True)
class Lease:
    id: int
    ttl: int


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's convention)."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"


# A compare or an operation of a transaction, in the gateway's JSON shape (see the builders).
Compare = dict[str, str]
Operation = dict[str, Any]


def if_absent(key: str) -> Compare:
    """The compare that holds while ``key`` does not exist."""
    return {"target": "CREATE", "key": _b64(key), "result": "EQUAL", "create_revision": "0"}


def if_unchanged(key: str, mod_revision: int) -> Compare:
    """The compare that holds while ``key`` was last modified at ``mod_revision``."""
    return {"target": "MOD", "key": _b64(key), "result": "EQUAL", "mod_revision": str(mod_revision)}


def if_nothing_changed_under(prefix: str, revision: int) -> Compare:
    """The compare that holds while no key under ``prefix`` was written after ``revision`` (a
    key deleted since is not seen: compare the deletion's side effects where it matters)."""
    return {
        "target": "MOD",
        "key": _b64(prefix),
        "range_end": _b64(prefix_end(prefix)),
        "result": "LESS",
        "mod_revision": str(revision + 1),
    }


def put_op(key: str, value: bytes, *, lease: int = 0) -> Operation:
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def delete_op(key: str) -> Operation:
    return {"request_delete_range": {"key": _b64(key)}}


def delete_prefix_op(prefix: str) -> Operation:
    return {"request_delete_range": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(item["key"]).decode(),
        value=_unb64(item.get("value", "")),
        create_revision=int(item.get("create_revision", 0)),
        mod_revision=int(item.get("mod_revision", 0)),
        version=int(item.get("version", 0)),
        lease=int(item.get("lease", 0)),
    )


def _revision(body: dict[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


def _raise_for_error(error: Any) -> None:
    """Turn the gateway's error object into an exception (a no-op without one)."""
    if isinstance(error, dict) and "code" in error:
        code, message = int(error["code"]), str(error.get("message", ""))
    elif isinstance(error, dict):
        code, message = int(error.get("grpc_code", 2)), str(error.get("message", ""))
    else:
        return
    if code == GRPC_UNAVAILABLE:
        raise EtcdUnavailable(message)
    raise EtcdRequestError(code, message)


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stream's non-empty lines, however long: a catch-up batch of watch events is one line
    that easily outgrows aiohttp's readline limit; a partial last line is dropped, unparsed."""
    buffer = bytearray()
    async for chunk in content.iter_any():
        scan_from = len(buffer)
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", scan_from)) >= 0:
            if buffer[start:end].strip():
                yield bytes(buffer[start:end])
            start = scan_from = end + 1
        del buffer[:start]
        if len(buffer) > WATCH_MAX_MESSAGE_BYTES:
            raise EtcdRequestError(
                GRPC_RESOURCE_EXHAUSTED, f"watch message over {WATCH_MAX_MESSAGE_BYTES} bytes"
            )


class EtcdClient:
    """Key-value, lease, transaction and watch calls against one etcd endpoint.

    The session belongs to the caller (the router shares its own); ``timeout`` bounds each
    unary call, connection included.
    """

    def __init__(
        self, session: aiohttp.ClientSession, endpoint: str, *, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._session = session
        self._endpoint = endpoint.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            async with self._session.post(
                f"{self._endpoint}/v3/{path}", data=orjson.dumps(payload), timeout=self._timeout
            ) as response:
                raw = await response.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EtcdUnavailable(f"etcd {path}: {exc!r}") from exc
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise EtcdUnavailable(f"etcd {path}: HTTP {response.status}, not JSON") from exc
        if response.status != 200:
            _raise_for_error(body)
            raise EtcdUnavailable(f"etcd {path}: HTTP {response.status}")
        return dict(body)

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Store ``value`` at ``key`` (attached to ``lease`` when non-zero); the new revision."""
        payload: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            payload["lease"] = str(lease)
        try:
            return _revision(await self._call("kv/put", payload))
        except EtcdRequestError as exc:
            if lease and exc.code == GRPC_NOT_FOUND:
                raise LeaseNotFound(lease) from exc
            raise

    async def get(self, key: str) -> KeyValue | None:
        kvs, _ = await self._range({"key": _b64(key)})
        return kvs[0] if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision they were read at (to watch from)."""
        return await self._range({"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})

    async def _range(self, payload: dict[str, Any]) -> tuple[list[KeyValue], int]:
        body = await self._call("kv/range", payload)
        return [_kv(item) for item in body.get("kvs", [])], _revision(body)

    async def delete(self, key: str) -> int:
        """Delete ``key``; how many keys were deleted (0 or 1)."""
        body = await self._call("kv/deleterange", {"key": _b64(key)})
        return int(body.get("deleted", 0))

    async def delete_prefix(self, prefix: str) -> int:
        payload = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        body = await self._call("kv/deleterange", payload)
        return int(body.get("deleted", 0))

    async def put_if_absent(self, key: str, value: bytes, *, lease: int = 0) -> bool:
        """Create ``key`` only if no one has: the building block of locks and claims."""
        return (await self.txn([if_absent(key)], [put_op(key, value, lease=lease)])).succeeded

    async def put_if_unchanged(
        self, key: str, value: bytes, mod_revision: int, *, lease: int = 0
    ) -> bool:
        """Replace ``key`` only if it was last modified at ``mod_revision`` (compare-and-swap)."""
        ops = [put_op(key, value, lease=lease)]
        return (await self.txn([if_unchanged(key, mod_revision)], ops)).succeeded

    async def txn(self, compares: list[Compare], success: list[Operation]) -> TxnResult:
        """Apply every operation of ``success`` at one revision if every compare holds. Several
        keys change together or not at all (a claim and its lock)."""
        body = await self._call("kv/txn", {"compare": compares, "success": success})
        return TxnResult(bool(body.get("succeeded", False)), _revision(body))

    async def compact(self, revision: int) -> None:
        """Drop history before ``revision``; watches starting earlier get WatchCompacted."""
        await self._call("kv/compaction", {"revision": str(revision), "physical": True})

    async def grant_lease(self, ttl: int) -> Lease:
        """A new lease of ``ttl`` seconds; keys put with it vanish when it is not kept alive."""
        body = await self._call("lease/grant", {"TTL": str(ttl)})
        return Lease(id=int(body["ID"]), ttl=int(body["TTL"]))

    async def keepalive(self, lease_id: int) -> int:
        """Refresh the lease once; its renewed TTL. LeaseNotFound once it has expired."""
        body = await self._call("lease/keepalive", {"ID": str(lease_id)})
        ttl = int(body.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise LeaseNotFound(lease_id)
        return ttl

    async def revoke_lease(self, lease_id: int) -> None:
        """End the lease now, deleting its keys; LeaseNotFound if it is already gone."""
        try:
            await self._call("lease/revoke", {"ID": str(lease_id)})
        except EtcdRequestError as exc:
            if exc.code == GRPC_NOT_FOUND:
                raise LeaseNotFound(lease_id) from exc
            raise

    def watch_prefix(
        self, prefix: str, *, start_revision: int, reconnect_within: float = 30.0
    ) -> Watch:
        """Events under ``prefix`` from ``start_revision`` on (see :class:`Watch`)."""
        return Watch(self._session, self._endpoint, prefix, start_revision, reconnect_within)


class Watch:
    """An async iterator of :class:`WatchEvent`, in revision order, that survives reconnects.

    When the stream drops (etcd restarted, connection reset) the watch reconnects with backoff
    and resumes at ``next_revision``, so no event is lost or repeated. If etcd stays unreachable
    for ``reconnect_within`` seconds it raises EtcdUnavailable; the caller can start a new watch
    at ``next_revision`` later. WatchCompacted if that revision is no longer in etcd's history.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        endpoint: str,
        prefix: str,
        start_revision: int,
        reconnect_within: float,
    ) -> None:
        self._session = session
        self._endpoint = endpoint
        self._prefix = prefix
        self._reconnect_within = reconnect_within
        self._failing_since: float | None = None
        self.next_revision = start_revision

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[WatchEvent]:
        loop = asyncio.get_running_loop()
        pause = Backoff(WATCH_RETRY_INITIAL_S, WATCH_RETRY_MAX_S)
        self._failing_since = None
        while self._failing_since is None or (
            loop.time() - self._failing_since < self._reconnect_within
        ):
            try:
                async for event in self._stream():
                    yield event
            except (TimeoutError, aiohttp.ClientError, EtcdUnavailable):
                pass
            if self._failing_since is None:
                self._failing_since = loop.time()
                pause.reset()
            await pause.sleep()
        raise EtcdUnavailable(f"etcd watch on {self._prefix!r}: unreachable, gave up")

    async def _stream(self) -> AsyncIterator[WatchEvent]:
        """One watch stream from ``next_revision``; ends when etcd closes the connection."""
        create = {
            "key": _b64(self._prefix),
            "range_end": _b64(prefix_end(self._prefix)),
            "start_revision": str(self.next_revision),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=DEFAULT_TIMEOUT_S)
        async with self._session.post(
            f"{self._endpoint}/v3/watch",
            data=orjson.dumps({"create_request": create}),
            timeout=timeout,
        ) as response:
            if response.status != 200:
                raise EtcdUnavailable(f"etcd watch: HTTP {response.status}")
            self._failing_since = None
            async for line in _lines(response.content):
                for event in self._events_of(orjson.loads(line)):
                    self.next_revision = event.kv.mod_revision + 1
                    yield event

    def _events_of(self, message: dict[str, Any]) -> list[WatchEvent]:
        _raise_for_error(message.get("error"))
        result = message.get("result", {})
        if int(result.get("compact_revision", 0)):
            raise WatchCompacted(int(result["compact_revision"]))
        if result.get("canceled"):
            raise EtcdRequestError(2, str(result.get("cancel_reason", "watch canceled")))
        return [
            WatchEvent(type=EventType(item.get("type", "PUT")), kv=_kv(item["kv"]))
            for item in result.get("events", [])
        ]
