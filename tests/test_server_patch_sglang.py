"""server_patch on SGLang's real FastAPI app (runs only where `import sglang` works).

The launcher's `prepare()` parses real SGLang arguments and installs the patch on
`sglang.srt.entrypoints.http_server.app`; SGLang's global state then gets a stand-in for the
tokenizer manager's methods (role, load snapshots, native switch, generate), built from SGLang's
own message types. Requests go through the whole ASGI app (SGLang's middlewares and routes, ours
in front) over httpx's ASGI transport. Run it with the command in docs/server_patch.md.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("sglang", reason="sglang is not installed (pip install sglang>=0.5.21)")

import httpx
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.entrypoints import http_server
from sglang.srt.managers.io_struct import PdRoleSwitchReqOutput
from sglang.srt.managers.load_snapshot import DisaggregationMetrics, LoadSnapshot
from sglang.srt.managers.tokenizer_manager import ServerStatus

from server_patch import launch_server

pytestmark = [pytest.mark.sglang, pytest.mark.asyncio(loop_scope="module")]

BOOTSTRAP_PORT = 9123
WAIT = 10.0
ARGV = [
    "--model-path",
    "stand-in-model",
    "--disaggregation-mode",
    "prefill",
    "--disaggregation-transfer-backend",
    "mooncake",
    "--disaggregation-bootstrap-port",
    str(BOOTSTRAP_PORT),
]


class TokenizerManagerStandIn:
    """The tokenizer manager methods SGLang's routes and server_patch call, and nothing else.

    `generate_request` holds each request open until `release` is set; `pd_role_switch` follows
    the native rule (refused with safe_to_restore while a request is open).
    """

    def __init__(self, server_args) -> None:
        self.server_args = server_args
        self.disaggregation_mode = DisaggregationMode.PREFILL
        self.rid_to_state: dict[str, object] = {}
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.is_generation = True
        self.release = asyncio.Event()
        self.switch_requests: list = []
        self.waiting = 0
        self.kv_sending = 0
        self.scheduler_role: str | None = None  # what the schedulers report, when it differs

    async def get_loads(self, include=None, dp_rank=None) -> list[LoadSnapshot]:
        disagg = DisaggregationMetrics(
            mode=self.disaggregation_mode.value, prefill_inflight_queue_reqs=self.kv_sending
        )
        snapshot = LoadSnapshot(
            dp_rank=0,
            num_running_reqs=len(self.rid_to_state),
            num_waiting_reqs=self.waiting,
            disaggregation=disagg,
        )
        return [snapshot]

    async def get_internal_state(self) -> list[dict]:
        return [{"disaggregation_mode": self.scheduler_role or self.disaggregation_mode.value}]

    async def generate_request(self, obj, request=None):
        rid = f"req-{len(self.rid_to_state)}-{id(obj)}"
        self.rid_to_state[rid] = obj
        try:
            await self.release.wait()
            yield {"text": "ok", "meta_info": {"id": rid, "finish_reason": {"type": "length"}}}
        finally:
            self.rid_to_state.pop(rid, None)

    async def pd_role_switch(self, obj, request=None) -> PdRoleSwitchReqOutput:
        self.switch_requests.append(obj)
        old = self.disaggregation_mode.value
        if self.rid_to_state or self.waiting or self.kv_sending:
            return PdRoleSwitchReqOutput(
                success=False,
                message="instance is not idle; drain all requests before switching",
                old_role=old,
                new_role=obj.new_role,
                safe_to_restore=True,
            )
        self.disaggregation_mode = DisaggregationMode(obj.new_role)
        return PdRoleSwitchReqOutput(
            success=True, message="ok", old_role=old, new_role=obj.new_role
        )


@pytest.fixture(scope="module")
def server_args():
    """Parse and patch once: routes and middleware can be added to the app only once."""
    return launch_server.prepare(list(ARGV))


@pytest.fixture
async def manager(server_args, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
    standin = TokenizerManagerStandIn(server_args)
    http_server.set_global_state(
        http_server._GlobalState(
            tokenizer_manager=standin, template_manager=None, scheduler_info={}
        )
    )
    return standin


@pytest.fixture
async def client(manager):
    transport = httpx.ASGITransport(app=http_server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sglang") as http:
        yield http
        await http.post("/pd_drain", json={"drain": False})


async def _until(condition, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _until_draining(client: httpx.AsyncClient) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not (await client.get("/pd_role")).json()["draining"]:
        if loop.time() > deadline:
            raise AssertionError("timed out waiting for the gate to close")
        await asyncio.sleep(0.005)


async def test_launcher_turns_on_the_in_process_switch(server_args):
    assert "--enable-pd-role-switch" not in ARGV
    assert server_args.enable_pd_role_switch is True
    assert server_args.disaggregation_mode == "prefill"


async def test_pd_role_reports_role_bootstrap_port_and_load(client, manager):
    response = await client.get("/pd_role")
    assert response.status_code == 200
    status = response.json()
    assert status["role"] == "prefill"
    assert status["bootstrap_port"] == BOOTSTRAP_PORT
    assert status["idle"] is True
    assert status["draining"] is False
    assert status["switch_supported"] is True


async def test_pd_role_reports_the_schedulers_live_role(client, manager):
    manager.scheduler_role = "decode"
    assert (await client.get("/pd_role")).json()["role"] == "decode"


async def test_pd_role_counts_waiting_requests_and_kv_still_being_sent(client, manager):
    manager.waiting, manager.kv_sending = 2, 1
    status = (await client.get("/pd_role")).json()
    assert status["idle"] is False
    assert status["num_waiting"] == 3


async def test_convert_does_not_switch_while_kv_is_still_being_sent(client, manager):
    manager.kv_sending = 1
    response = await client.post("/convert_pd_role", json={"drain_timeout_secs": 0.1})
    assert response.status_code == 400
    assert response.json()["safe_to_restore"] is True
    assert manager.switch_requests == []
    assert manager.disaggregation_mode is DisaggregationMode.PREFILL


async def test_generate_is_served_by_sglang_while_admitting(client, manager):
    manager.release.set()
    response = await client.post("/generate", json={"text": "hello"})
    assert response.status_code == 200
    assert response.json()["text"] == "ok"


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_generation_routes_get_503_with_retry_after_while_draining(client, manager, path):
    drained = await client.post("/pd_drain", json={"drain": True})
    assert drained.json()["draining"] is True
    body = {"text": "hi", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    response = await client.post(path, json=body)
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert manager.rid_to_state == {}


async def test_health_and_status_routes_answer_while_draining(client, manager):
    await client.post("/pd_drain", json={"drain": True})
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/pd_role")).json()["draining"] is True


async def test_convert_waits_for_the_open_request_then_switches(client, manager):
    request = asyncio.create_task(client.post("/generate", json={"text": "long"}))
    await _until(lambda: manager.rid_to_state, "the request to reach the tokenizer manager")
    conversion = asyncio.create_task(client.post("/convert_pd_role", json={}))
    await _until_draining(client)
    refused = await client.post("/generate", json={"text": "late"})
    assert refused.status_code == 503
    assert manager.switch_requests == []
    manager.release.set()
    reply = (await asyncio.wait_for(conversion, WAIT)).json()
    assert (await asyncio.wait_for(request, WAIT)).status_code == 200
    assert reply["success"] is True
    assert (reply["old_role"], reply["new_role"]) == ("prefill", "decode")
    assert reply["bootstrap_port"] == BOOTSTRAP_PORT
    assert manager.disaggregation_mode is DisaggregationMode.DECODE
    status = (await client.get("/pd_role")).json()
    assert status["role"] == "decode"
    assert status["draining"] is False


async def test_native_pd_role_switch_route_goes_through_the_extension(client, manager):
    epoch = (await client.get("/pd_role")).json()["epoch"]
    response = await client.post("/pd_role_switch", json={"new_role": "decode"})
    assert response.status_code == 200
    assert response.json()["new_role"] == "decode"
    assert (await client.get("/pd_role")).json()["epoch"] == epoch + 1


async def test_convert_refuses_a_knob_the_switch_cannot_honour_naming_it(client, manager):
    response = await client.post("/convert_pd_role", json={"disable_radix_cache": True})
    assert response.status_code == 400
    assert response.json()["field"] == "disable_radix_cache"
    assert manager.switch_requests == []


async def test_convert_with_invalid_json_is_a_400(client, manager):
    response = await client.post(
        "/convert_pd_role", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["success"] is False


async def test_convert_timeout_reopens_admission(client, manager):
    request = asyncio.create_task(client.post("/generate", json={"text": "long"}))
    await _until(lambda: manager.rid_to_state, "the request to reach the tokenizer manager")
    response = await client.post("/convert_pd_role", json={"drain_timeout_secs": 0.1})
    assert response.status_code == 400
    assert response.json()["safe_to_restore"] is True
    assert (await client.get("/pd_role")).json()["draining"] is False
    manager.release.set()
    assert (await asyncio.wait_for(request, WAIT)).status_code == 200


async def test_launcher_refuses_a_server_without_pd_mode():
    with pytest.raises(launch_server.LaunchError, match="--disaggregation-mode"):
        launch_server.prepare(["--model-path", "stand-in-model"])


async def test_launcher_refuses_several_tokenizer_workers():
    argv = [*ARGV, "--tokenizer-worker-num", "2"]
    with pytest.raises(launch_server.LaunchError, match="tokenizer"):
        launch_server.prepare(argv)


async def test_launcher_exits_with_status_2_instead_of_starting_a_non_pd_server():
    assert launch_server.main(["--model-path", "stand-in-model"]) == 2
