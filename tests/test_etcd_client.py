"""pd_protocol.etcd_client against a real etcd on loopback (tests/etcd_helpers.py)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator

import aiohttp
import pytest
import pytest_asyncio

from pd_protocol.etcd_client import (
    EtcdClient,
    EtcdUnavailable,
    EventType,
    LeaseNotFound,
    Watch,
    WatchCompacted,
    WatchEvent,
    delete_op,
    if_absent,
    if_nothing_changed_under,
    put_op,
)
from pd_worker.cluster import LOOPBACK, free_port
from tests.etcd_helpers import EtcdServer

LEASE_EXPIRY_WAIT_S = 10.0


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client_session:
        yield client_session


@pytest.fixture
def etcd(etcd_server: EtcdServer, session: aiohttp.ClientSession) -> EtcdClient:
    return EtcdClient(session, etcd_server.url, timeout=2.0)


async def _next_events(watch: AsyncIterator[WatchEvent], count: int) -> list[WatchEvent]:
    return [await asyncio.wait_for(anext(watch), timeout=10.0) for _ in range(count)]


def _events(watch: Watch) -> AsyncIterator[WatchEvent]:
    return aiter(watch)


async def test_put_then_get_returns_the_value(etcd: EtcdClient) -> None:
    revision = await etcd.put("/pd/workers/a", b"prefill")
    kv = await etcd.get("/pd/workers/a")
    assert kv is not None
    assert (kv.value, kv.mod_revision) == (b"prefill", revision)


async def test_get_of_a_missing_key_is_none(etcd: EtcdClient) -> None:
    assert await etcd.get("/pd/nothing") is None


async def test_get_prefix_returns_only_keys_under_the_prefix(etcd: EtcdClient) -> None:
    await etcd.put("/pd/workers/a", b"1")
    await etcd.put("/pd/workers/b", b"2")
    await etcd.put("/pd/workersX", b"3")
    last = await etcd.put("/pd/other", b"4")
    kvs, revision = await etcd.get_prefix("/pd/workers/")
    assert [(kv.key, kv.value) for kv in kvs] == [("/pd/workers/a", b"1"), ("/pd/workers/b", b"2")]
    assert revision == last


async def test_delete_removes_the_key(etcd: EtcdClient) -> None:
    await etcd.put("/pd/k", b"v")
    assert await etcd.delete("/pd/k") == 1
    assert await etcd.get("/pd/k") is None


async def test_a_transaction_applies_all_its_operations_or_none(etcd: EtcdClient) -> None:
    await etcd.put("/pd/taken", b"x")
    await etcd.put("/pd/old", b"x")
    ops = [put_op("/pd/a", b"1"), put_op("/pd/b", b"2"), delete_op("/pd/old")]
    assert (await etcd.txn([if_absent("/pd/a"), if_absent("/pd/taken")], ops)).succeeded is False
    assert (await etcd.get("/pd/a"), await etcd.get("/pd/old") is not None) == (None, True)
    done = await etcd.txn([if_absent("/pd/a")], ops)
    assert done.succeeded is True
    assert (await etcd.get("/pd/b")).mod_revision == done.revision
    assert [kv.key for kv in (await etcd.get_prefix("/pd/"))[0]] == ["/pd/a", "/pd/b", "/pd/taken"]


async def test_nothing_changed_under_a_prefix_fails_after_a_write_there(etcd: EtcdClient) -> None:
    await etcd.put("/pd/workers/a", b"1")
    _, revision = await etcd.get_prefix("/pd/workers/")
    await etcd.put("/pd/elsewhere", b"2")
    unchanged = [if_nothing_changed_under("/pd/workers/", revision)]
    assert (await etcd.txn(unchanged, [put_op("/pd/claim", b"1")])).succeeded is True
    await etcd.put("/pd/workers/b", b"3")
    assert (await etcd.txn(unchanged, [put_op("/pd/claim2", b"1")])).succeeded is False


async def test_put_if_absent_creates_once(etcd: EtcdClient) -> None:
    assert await etcd.put_if_absent("/pd/lock", b"replica-1") is True
    assert await etcd.put_if_absent("/pd/lock", b"replica-2") is False
    kv = await etcd.get("/pd/lock")
    assert kv is not None and kv.value == b"replica-1"


async def test_put_if_unchanged_refuses_a_stale_revision(etcd: EtcdClient) -> None:
    first = await etcd.put("/pd/w", b"v1")
    await etcd.put("/pd/w", b"v2")
    assert await etcd.put_if_unchanged("/pd/w", b"v3", first) is False
    current = await etcd.get("/pd/w")
    assert current is not None
    assert await etcd.put_if_unchanged("/pd/w", b"v3", current.mod_revision) is True


async def test_a_key_under_an_expired_lease_disappears(etcd: EtcdClient) -> None:
    lease = await etcd.grant_lease(1)
    await etcd.put("/pd/self/w1", b"up", lease=lease.id)
    deadline = asyncio.get_running_loop().time() + LEASE_EXPIRY_WAIT_S
    while await etcd.get("/pd/self/w1") is not None:
        assert asyncio.get_running_loop().time() < deadline, "leased key outlived its lease"
        await asyncio.sleep(0.2)
    with pytest.raises(LeaseNotFound):
        await etcd.keepalive(lease.id)


async def test_keepalive_keeps_a_leased_key(etcd: EtcdClient) -> None:
    lease = await etcd.grant_lease(2)
    await etcd.put("/pd/self/w1", b"up", lease=lease.id)
    for _ in range(8):
        assert await etcd.keepalive(lease.id) == 2
        await asyncio.sleep(0.5)
    kv = await etcd.get("/pd/self/w1")
    assert kv is not None and kv.lease == lease.id


async def test_revoking_a_lease_deletes_its_keys(etcd: EtcdClient) -> None:
    lease = await etcd.grant_lease(30)
    await etcd.put("/pd/self/w1", b"up", lease=lease.id)
    await etcd.revoke_lease(lease.id)
    assert await etcd.get("/pd/self/w1") is None
    with pytest.raises(LeaseNotFound):
        await etcd.revoke_lease(lease.id)


async def test_watch_sees_puts_and_deletes_in_order(etcd: EtcdClient) -> None:
    _, revision = await etcd.get_prefix("/pd/workers/")
    watch = _events(etcd.watch_prefix("/pd/workers/", start_revision=revision + 1))
    await etcd.put("/pd/workers/a", b"1")
    await etcd.put("/pd/elsewhere", b"x")
    await etcd.put("/pd/workers/b", b"2")
    await etcd.delete("/pd/workers/a")
    events = await _next_events(watch, 3)
    assert [(e.type, e.kv.key) for e in events] == [
        (EventType.PUT, "/pd/workers/a"),
        (EventType.PUT, "/pd/workers/b"),
        (EventType.DELETE, "/pd/workers/a"),
    ]
    assert events[1].kv.value == b"2"


async def test_watch_resumes_after_etcd_restarts(
    etcd: EtcdClient,
    etcd_server: EtcdServer,
) -> None:
    _, revision = await etcd.get_prefix("/pd/workers/")
    watch = etcd.watch_prefix("/pd/workers/", start_revision=revision + 1)
    events = _events(watch)
    await etcd.put("/pd/workers/a", b"before")
    [before] = await _next_events(events, 1)
    await asyncio.to_thread(etcd_server.stop)
    await asyncio.to_thread(etcd_server.start)
    await etcd.put("/pd/workers/b", b"after")
    await etcd.delete("/pd/workers/a")
    after = await _next_events(events, 2)
    assert before.kv.value == b"before"
    assert [(e.type, e.kv.key) for e in after] == [
        (EventType.PUT, "/pd/workers/b"),
        (EventType.DELETE, "/pd/workers/a"),
    ]
    assert watch.next_revision == after[-1].kv.mod_revision + 1


async def test_calls_raise_etcd_unavailable_when_etcd_is_stopped(
    etcd: EtcdClient,
    etcd_server: EtcdServer,
) -> None:
    await etcd.put("/pd/k", b"v")
    await asyncio.to_thread(etcd_server.stop)
    with pytest.raises(EtcdUnavailable):
        await etcd.get("/pd/k")
    with pytest.raises(EtcdUnavailable):
        await etcd.put("/pd/k", b"w")


async def test_etcd_unavailable_when_nothing_listens(session: aiohttp.ClientSession) -> None:
    client = EtcdClient(session, f"http://{LOOPBACK}:{free_port()}", timeout=1.0)
    with pytest.raises(EtcdUnavailable):
        await client.grant_lease(5)


async def test_watch_gives_up_with_etcd_unavailable_after_its_reconnect_window(
    session: aiohttp.ClientSession,
) -> None:
    client = EtcdClient(session, f"http://{LOOPBACK}:{free_port()}", timeout=1.0)
    watch = _events(client.watch_prefix("/pd/", start_revision=1, reconnect_within=0.5))
    with pytest.raises(EtcdUnavailable):
        await asyncio.wait_for(anext(watch), timeout=10.0)


async def test_a_call_to_a_hung_etcd_times_out_as_etcd_unavailable(
    etcd: EtcdClient,
    etcd_server: EtcdServer,
) -> None:
    await etcd.put("/pd/k", b"v")
    assert etcd_server.process is not None
    etcd_server.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(EtcdUnavailable):
            await etcd.get("/pd/k")
    finally:
        etcd_server.process.send_signal(signal.SIGCONT)


async def test_put_with_an_unknown_lease_raises_lease_not_found(etcd: EtcdClient) -> None:
    with pytest.raises(LeaseNotFound):
        await etcd.put("/pd/self/w1", b"up", lease=12345)


async def test_watch_from_a_compacted_revision_raises_watch_compacted(etcd: EtcdClient) -> None:
    first = await etcd.put("/pd/workers/a", b"1")
    latest = await etcd.put("/pd/workers/a", b"2")
    await etcd.compact(latest)
    watch = _events(etcd.watch_prefix("/pd/workers/", start_revision=first))
    with pytest.raises(WatchCompacted) as raised:
        await asyncio.wait_for(anext(watch), timeout=10.0)
    assert raised.value.compact_revision == latest


async def test_watch_delivers_a_catch_up_batch_larger_than_aiohttp_line_limit(
    etcd: EtcdClient,
) -> None:
    first = await etcd.put("/pd/workers/0000", b"x" * 1000)
    for index in range(1, 800):
        await etcd.put(f"/pd/workers/{index:04d}", b"x" * 1000)
    watch = _events(etcd.watch_prefix("/pd/workers/", start_revision=first))
    events = await _next_events(watch, 800)
    assert [e.kv.key for e in events] == [f"/pd/workers/{index:04d}" for index in range(800)]
