"""pd_protocol.registration: a worker's own record in etcd under its lease, against a real etcd.

The registration runs in the test's process here (its refresh loop, endpoint failover and
re-registration); tests/test_worker_registration.py runs it inside real pd-worker processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
import pytest_asyncio

from pd_protocol.cluster import ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import EtcdClient, EventType, KeyValue, WatchEvent
from pd_protocol.registration import (
    RegistrationSettings,
    SelfRegistration,
    registered_record,
)
from pd_worker.cluster import LOOPBACK, free_port
from tests.etcd_helpers import EtcdServer

TTL = 2
WAIT_S = 10.0
# etcd frozen longer than the lease: it expires the lease when it resumes.
STALL_S = TTL + 1.5
KEYS = ClusterKeys("c1")
URL = "http://127.0.0.1:30000"


class LiveRole:
    """The worker state a registration reads: role and bootstrap port, changed by the test."""

    def __init__(self) -> None:
        self.role = "prefill"
        self.bootstrap_port: int | None = 8998

    def __call__(self) -> tuple[str, int | None]:
        return self.role, self.bootstrap_port


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client_session:
        yield client_session


@pytest.fixture
def etcd(etcd_server: EtcdServer, session: aiohttp.ClientSession) -> EtcdClient:
    return EtcdClient(session, etcd_server.url, timeout=2.0)


@pytest.fixture
def endpoint(etcd_server: EtcdServer) -> str:
    return etcd_server.url


@pytest_asyncio.fixture
async def registrations() -> AsyncIterator[list[SelfRegistration]]:
    """Registrations a test starts; stopped at teardown even when the test fails."""
    started: list[SelfRegistration] = []
    yield started
    for registration in started:
        await registration.stop()


async def _start(
    started: list[SelfRegistration],
    session: aiohttp.ClientSession,
    endpoints: list[str],
    live: LiveRole,
) -> SelfRegistration:
    registration = SelfRegistration(session, endpoints, KEYS, URL, live, ttl=TTL)
    started.append(registration)
    await registration.start()
    return registration


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {WAIT_S}s: {what}")


async def _stored(etcd: EtcdClient) -> KeyValue | None:
    return await etcd.get(KEYS.worker(URL))


async def _record(etcd: EtcdClient) -> WorkerRecord | None:
    kv = await _stored(etcd)
    return None if kv is None else WorkerRecord.decode(kv.value)


async def _put_again(etcd: EtcdClient, *old_leases: int) -> WorkerRecord:
    """The record, once it is put under a lease other than ``old_leases``."""

    async def put_again() -> bool:
        kv = await _stored(etcd)
        return kv is not None and kv.lease not in (0, *old_leases)

    await _until(put_again, "the record put again under a new lease")
    record = await _record(etcd)
    assert record is not None
    return record


# ---------------------------------------------------------------- the record, on recorded inputs


def test_a_first_record_is_the_live_role_from_the_worker_itself() -> None:
    record = registered_record(URL, "decode", 9000, None)
    assert record == WorkerRecord(url=URL, role="decode", bootstrap_port=9000, source="self")


def test_a_regular_servers_null_mode_is_put_as_the_regular_role() -> None:
    record = registered_record(URL, "null", None, None)
    assert record == WorkerRecord(url=URL, role="regular", bootstrap_port=None, source="self")


def test_a_stored_record_in_the_live_role_keeps_its_epoch() -> None:
    stored = WorkerRecord(url=URL, role="decode", bootstrap_port=9000, epoch=3, source="api")
    record = registered_record(URL, "decode", 9000, stored)
    assert (record.role, record.epoch, record.source) == ("decode", 3, "self")


def test_a_stored_record_in_another_role_gets_the_live_role_and_the_next_epoch() -> None:
    stored = WorkerRecord(url=URL, role="decode", bootstrap_port=9000, epoch=3)
    record = registered_record(URL, "prefill", 9001, stored)
    assert (record.role, record.bootstrap_port, record.epoch) == ("prefill", 9001, 4)


def test_a_stored_conversion_is_kept_for_the_routers_to_finish() -> None:
    stored = WorkerRecord(
        url=URL,
        role="prefill",
        state="switching",
        conversion="conv-1",
        owner="replica-a",
        to_role="decode",
    )
    record = registered_record(URL, "decode", None, stored)
    assert (record.state, record.conversion, record.owner, record.to_role) == (
        "switching",
        "conv-1",
        "replica-a",
        "decode",
    )


def test_a_stored_record_marked_removing_is_registered_afresh_keeping_its_epoch() -> None:
    stored = WorkerRecord(url=URL, role="decode", epoch=2, state="removing", source="api")
    record = registered_record(URL, "decode", None, stored)
    assert record == WorkerRecord(url=URL, role="decode", epoch=2, source="self")


def test_settings_without_a_cluster_name_are_refused() -> None:
    with pytest.raises(ValueError, match="cluster name"):
        RegistrationSettings(endpoints=("http://127.0.0.1:2379",), cluster="").validate()


def test_settings_with_an_etcd_address_that_is_no_url_are_refused() -> None:
    with pytest.raises(ValueError, match="not an http"):
        RegistrationSettings(endpoints=("127.0.0.1:2379",), cluster="c1").validate()


# ---------------------------------------------------------------- against a real etcd


async def test_start_puts_the_live_role_and_bootstrap_port_under_a_lease(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [endpoint], LiveRole())
    kv = await _stored(etcd)
    assert kv is not None
    assert kv.lease == registration.lease_id != 0
    assert WorkerRecord.decode(kv.value) == WorkerRecord(
        url=URL, role="prefill", bootstrap_port=8998, source="self"
    )


async def test_stop_revokes_the_lease_so_the_record_goes_at_once(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [endpoint], LiveRole())
    await registration.stop()
    assert await _stored(etcd) is None
    await registration.stop()


async def test_stop_returns_when_etcd_is_down(
    etcd_server: EtcdServer,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [etcd_server.url], LiveRole())
    etcd_server.stop()
    await asyncio.wait_for(registration.stop(), timeout=WAIT_S)
    assert registration.lease_id is None


async def test_the_record_outlives_the_ttl_while_the_worker_lives(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [endpoint], LiveRole())
    await asyncio.sleep(2 * TTL)
    kv = await _stored(etcd)
    assert kv is not None and kv.lease == registration.lease_id


async def test_a_record_a_router_changed_under_the_lease_is_kept_as_changed(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [endpoint], LiveRole())
    converted = WorkerRecord(url=URL, role="decode", bootstrap_port=8998, epoch=1, source="self")
    await etcd.put(KEYS.worker(URL), converted.encode(), lease=registration.lease_id or 0)
    await asyncio.sleep(2 * TTL)
    assert await _record(etcd) == converted


async def test_a_lost_lease_is_replaced_and_the_record_put_again_with_the_live_role(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    live = LiveRole()
    registration = await _start(registrations, session, [endpoint], live)
    first_lease = registration.lease_id or 0
    live.role = "decode"
    await etcd.revoke_lease(first_lease)

    async def put_again() -> bool:
        record = await _record(etcd)
        return record is not None and record.role == "decode"

    await _until(put_again, "the record put again after its lease was revoked")
    kv = await _stored(etcd)
    assert kv is not None and kv.lease not in (0, first_lease)


async def test_a_record_put_again_over_a_routers_record_moves_the_epoch_to_the_live_role(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [endpoint], LiveRole())
    lease = registration.lease_id or 0
    # A router recorded the worker as decode (under a lease of its own), then the worker's
    # lease was lost; the worker is a prefill.
    router_lease = await etcd.grant_lease(60)
    router_record = WorkerRecord(url=URL, role="decode", epoch=4)
    await etcd.put(KEYS.worker(URL), router_record.encode(), lease=router_lease.id)
    await etcd.revoke_lease(lease)

    record = await _put_again(etcd, lease, router_lease.id)
    assert (record.role, record.epoch) == ("prefill", 5)


async def test_a_record_lost_with_its_lease_is_put_again_with_its_epoch_moved_on(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    """A router converted the worker (epoch 1), then its lease went: the record put again
    carries the epoch on, not a first registration's 0."""
    live = LiveRole()
    registration = await _start(registrations, session, [endpoint], live)
    lease = registration.lease_id or 0
    live.role = "decode"
    await etcd.put(
        KEYS.worker(URL), WorkerRecord(URL, "decode", epoch=1, source="self").encode(), lease=lease
    )
    await etcd.revoke_lease(lease)

    record = await _put_again(etcd, lease)
    assert (record.role, record.epoch) == ("decode", 1)


async def test_an_etcd_stall_longer_than_the_ttl_is_ridden_out_and_counted_as_unregistered(
    etcd_server: EtcdServer,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    registration = await _start(registrations, session, [etcd_server.url], LiveRole())
    lease = registration.lease_id
    with etcd_server.stalled():
        await asyncio.sleep(STALL_S)
        during = registration.stats()

    async def back() -> bool:
        kv = await _stored(etcd)
        return kv is not None and kv.lease not in (0, lease) and registration.stats().registered

    await _until(back, "registered again under a new lease")
    after = registration.stats()
    assert (during.registered, during.lapses) == (False, 1)
    assert after.lapses == 1
    assert 0 < after.unregistered_secs < STALL_S + WAIT_S


async def test_stop_marks_the_record_removing_before_it_revokes_the_lease(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    """Routers then take the worker out at once, instead of waiting out the grace period they
    give a record that goes without a word."""
    registration = await _start(registrations, session, [endpoint], LiveRole())
    kv = await _stored(etcd)
    assert kv is not None
    await registration.stop()
    watch = etcd.watch_prefix(KEYS.worker(URL), start_revision=kv.mod_revision + 1)
    seen: list[WatchEvent] = []
    async with contextlib.aclosing(aiter(watch)) as events:
        async for event in events:
            seen.append(event)
            if len(seen) == 2:
                break
    assert [e.type for e in seen] == [EventType.PUT, EventType.DELETE]
    assert WorkerRecord.decode(seen[0].kv.value).state == "removing"


class RouterWritesOnRead(LiveRole):
    """A worker whose role is read just after a router wrote its record: the registration's
    compare-and-swap then fails once and must read the record again."""

    def __init__(self, etcd_url: str, record: WorkerRecord) -> None:
        super().__init__()
        self.armed = False
        self._etcd_url = etcd_url
        self._record = record

    def __call__(self) -> tuple[str, int | None]:
        if self.armed:
            self.armed = False
            # The registration awaits nothing while it reads the role: the router's write runs
            # on a loop of its own, in another thread.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, self._router_put()).result()
        return super().__call__()

    async def _router_put(self) -> None:
        async with aiohttp.ClientSession() as session:
            await EtcdClient(session, self._etcd_url).put(KEYS.worker(URL), self._record.encode())


async def test_a_record_a_router_writes_during_a_put_is_read_again_before_the_put(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    live = RouterWritesOnRead(endpoint, WorkerRecord(url=URL, role="decode", epoch=7))
    registration = await _start(registrations, session, [endpoint], live)
    lease = registration.lease_id or 0
    live.armed = True
    await etcd.revoke_lease(lease)

    record = await _put_again(etcd, lease)
    assert (record.role, record.epoch) == ("prefill", 8)


async def test_etcd_restarted_after_the_ttl_has_the_record_again_and_one_warning_was_logged(
    etcd_server: EtcdServer,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pd_protocol.registration")
    await _start(registrations, session, [etcd_server.url], LiveRole())
    etcd_server.stop()
    await asyncio.sleep(TTL + 1)
    etcd_server.start()

    async def present() -> bool:
        return await _stored(etcd) is not None

    await _until(present, "the record back after etcd restarted")
    await asyncio.sleep(2 * TTL)
    assert await _stored(etcd) is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


async def test_a_registration_started_while_etcd_is_down_registers_once_it_answers(
    etcd_server: EtcdServer,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pd_protocol.registration")
    etcd_server.stop()
    await _start(registrations, session, [etcd_server.url], LiveRole())
    await asyncio.sleep(1.0)
    etcd_server.start()

    async def present() -> bool:
        return await _stored(etcd) is not None

    await _until(present, "the record once etcd answered")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


async def test_the_next_endpoint_is_used_when_the_first_does_not_answer(
    endpoint: str,
    etcd: EtcdClient,
    session: aiohttp.ClientSession,
    registrations: list[SelfRegistration],
) -> None:
    dead = f"http://{LOOPBACK}:{free_port()}"
    await _start(registrations, session, [dead, endpoint], LiveRole())
    assert await _record(etcd) is not None
