"""The SGLang launcher's self-registration (``--pd-router-etcd``), without SGLang.

The flags are taken out of the command line before SGLang sees it, and the registration wraps
the app's lifespan; both are tested here against a real etcd, with a stand-in for what SGLang
provides (the lifespan of its FastAPI app and its role backend). Registration inside a real
SGLang server runs only where SGLang is installed and is not covered here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from pd_protocol.cluster import ClusterKeys, WorkerRecord
from pd_protocol.etcd_client import EtcdClient
from pd_protocol.extension import Load, PDExtension
from pd_protocol.registration import RegistrationSettings
from server_patch import launch_server
from server_patch.preflight import LaunchError
from server_patch.registration import install_registration, split_registration_args
from tests.etcd_helpers import EtcdServer

BOOTSTRAP_PORT = 9123
OWN_URL = "http://127.0.0.1:30000"
KEYS = ClusterKeys("c1")
TTL = 2
WAIT_S = 10.0
SGLANG_ARGS = ["--model-path", "m", "--disaggregation-mode", "prefill", "--port", "30000"]


class ServerStandIn:
    """The role backend of an idle SGLang server: live role, load and the native switch."""

    def __init__(self) -> None:
        self.role = "prefill"

    async def current_role(self) -> str:
        return self.role

    async def load(self) -> Load:
        return Load(num_running=0, num_waiting=0, idle=True)

    async def switch_role(self, request: dict) -> dict:
        old, self.role = self.role, request["new_role"]
        return {
            "success": True,
            "message": "ok",
            "old_role": old,
            "new_role": self.role,
            "safe_to_restore": False,
        }

    def bootstrap_port(self) -> int | None:
        return BOOTSTRAP_PORT

    def switch_supported(self) -> bool:
        return True


class AppStandIn:
    """What the registration touches of SGLang's FastAPI app: ``router.lifespan_context``,
    here a lifespan that records SGLang's startup and shutdown."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.router = SimpleNamespace(lifespan_context=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[dict[str, bool]]:
        self.events.append("startup")
        yield {"sglang_state": True}
        self.events.append("shutdown")


@pytest_asyncio.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with aiohttp.ClientSession() as session:
        yield EtcdClient(session, etcd_server.url, timeout=2.0)


def _settings(etcd_server: EtcdServer, **changes: Any) -> RegistrationSettings:
    return RegistrationSettings(
        endpoints=(etcd_server.url,), cluster=KEYS.name, lease_ttl=TTL, **changes
    )


async def _record(etcd: EtcdClient, url: str = OWN_URL) -> WorkerRecord | None:
    kv = await etcd.get(KEYS.worker(url))
    return None if kv is None else WorkerRecord.decode(kv.value)


# ---------------------------------------------------------------- the command line


def test_our_flags_are_taken_out_and_sglangs_are_left_in_order() -> None:
    argv = [
        "--model-path", "m", "--pd-router-etcd", "http://127.0.0.1:2379",
        "--disaggregation-mode", "prefill", "--pd-router-cluster=c1",
        "--pd-router-etcd-lease-ttl", "3", "--port", "30000",
        "--pd-router-advertise-url", "http://10.0.0.5:30000",
    ]  # fmt: skip
    settings, rest = split_registration_args(argv)
    assert rest == SGLANG_ARGS
    assert settings == RegistrationSettings(
        endpoints=("http://127.0.0.1:2379",),
        cluster="c1",
        advertise_url="http://10.0.0.5:30000",
        lease_ttl=3,
    )


def test_etcd_may_be_given_several_times() -> None:
    argv = ["--pd-router-etcd", "http://a:2379", "--pd-router-etcd", "http://b:2379"]
    settings, _ = split_registration_args([*argv, "--pd-router-cluster", "c1"])
    assert settings is not None and settings.endpoints == ("http://a:2379", "http://b:2379")


def test_without_our_flags_the_arguments_are_untouched() -> None:
    assert split_registration_args(SGLANG_ARGS) == (None, SGLANG_ARGS)


def test_an_abbreviation_of_our_flags_is_left_to_sglang() -> None:
    _, rest = split_registration_args(["--pd-router-clu", "c1"])
    assert rest == ["--pd-router-clu", "c1"]


def test_etcd_without_a_cluster_name_is_refused_naming_the_missing_flag() -> None:
    with pytest.raises(LaunchError, match="--pd-router-cluster"):
        split_registration_args(["--pd-router-etcd", "http://127.0.0.1:2379", *SGLANG_ARGS])


def test_a_cluster_name_without_etcd_is_refused() -> None:
    with pytest.raises(LaunchError, match="--pd-router-etcd"):
        split_registration_args(["--pd-router-cluster", "c1", *SGLANG_ARGS])


def test_the_launcher_refuses_bad_registration_flags_before_looking_for_sglang() -> None:
    with pytest.raises(LaunchError, match="--pd-router-cluster"):
        launch_server.prepare(["--pd-router-etcd", "http://127.0.0.1:2379", *SGLANG_ARGS])


# ---------------------------------------------------------------- the lifespan, with etcd


async def test_the_server_is_registered_between_sglangs_startup_and_shutdown(
    etcd_server: EtcdServer, etcd: EtcdClient
) -> None:
    app = AppStandIn()
    install_registration(app, PDExtension(ServerStandIn()), _settings(etcd_server), OWN_URL)
    async with app.router.lifespan_context(app) as state:
        assert state == {"sglang_state": True}
        assert app.events == ["startup"]
        assert await _record(etcd) == WorkerRecord(
            url=OWN_URL, role="prefill", bootstrap_port=BOOTSTRAP_PORT, source="self"
        )
    assert app.events == ["startup", "shutdown"]
    assert await _record(etcd) is None


async def test_the_advertise_url_is_the_registered_one(
    etcd_server: EtcdServer, etcd: EtcdClient
) -> None:
    app = AppStandIn()
    settings = _settings(etcd_server, advertise_url="http://10.0.0.5:30000")
    install_registration(app, PDExtension(ServerStandIn()), settings, OWN_URL)
    async with app.router.lifespan_context(app):
        assert await _record(etcd, "http://10.0.0.5:30000") is not None
        assert await _record(etcd) is None


async def test_a_record_put_again_after_a_switch_carries_the_new_role(
    etcd_server: EtcdServer, etcd: EtcdClient
) -> None:
    app = AppStandIn()
    extension = PDExtension(ServerStandIn())
    install_registration(app, extension, _settings(etcd_server), OWN_URL)
    async with app.router.lifespan_context(app):
        status, _ = await extension.switch({"new_role": "decode"})
        assert status == 200
        first = await etcd.get(KEYS.worker(OWN_URL))
        assert first is not None
        await etcd.revoke_lease(first.lease)
        deadline = time.monotonic() + WAIT_S
        record = None
        while time.monotonic() < deadline and (record is None or record.role != "decode"):
            await asyncio.sleep(0.05)
            record = await _record(etcd)
        assert record is not None and record.role == "decode"
