"""PDExtension, the shared logic behind /pd_role, /pd_drain and /convert_pd_role, and the
admission gate (raw ASGI middleware) that server_patch puts in front of SGLang's routes.

The backend here is a small in-test stand-in for SGLang's tokenizer manager (its role, load and
native in-process switch, with SGLang's idle rule and reply shape); the extension under test is
the real code. pd_worker's integration tests drive the same code through real HTTP.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pd_protocol.extension import ExtensionError, Load, PDExtension
from server_patch.admission import AdmissionMiddleware, InFlight

BOOTSTRAP_PORT = 8998
WAIT = 5.0  # bound on every wait in this module


class SchedulerStandIn:
    """Role, load and native switch of one server, with SGLang's rules.

    `notify` wires load changes to the extension's `load_changed()` (event-driven drain);
    without it the extension has to poll.
    """

    def __init__(self, role: str = "prefill", *, switch_enabled: bool = True) -> None:
        self.role = role
        self.running = 0
        self.waiting = 0
        self.arrive_on_switch = 0  # requests that reach the scheduler just as a switch arrives
        self.teardown_fails = False
        self.switch_enabled = switch_enabled
        self.switch_requests: list[dict] = []
        self.notify = None

    def start_request(self) -> None:
        self.running += 1
        self._changed()

    def finish_request(self) -> None:
        self.running -= 1
        self._changed()

    def _changed(self) -> None:
        if self.notify is not None:
            self.notify()

    async def current_role(self) -> str:
        return self.role

    async def load(self) -> Load:
        idle = self.running == 0 and self.waiting == 0
        return Load(num_running=self.running, num_waiting=self.waiting, idle=idle)

    async def switch_role(self, request: dict) -> dict:
        self.switch_requests.append(request)
        old, new = self.role, request["new_role"]
        if self.arrive_on_switch:
            self.running += self.arrive_on_switch
            self.arrive_on_switch = 0
        if new == old:
            return _native(True, "ok", old, new, safe=False)
        if self.running or self.waiting:
            return _native(
                False, "instance is not idle; drain all requests before switching", old, new, True
            )
        if self.teardown_fails:
            return _native(False, "role switch failed; instance unhealthy", old, new, False)
        self.role = new
        return _native(True, "ok", old, new, safe=False)

    def bootstrap_port(self) -> int | None:
        return BOOTSTRAP_PORT

    def switch_supported(self) -> bool:
        return self.switch_enabled


def _native(success: bool, message: str, old: str, new: str, safe: bool) -> dict:
    return {
        "success": success,
        "message": message,
        "old_role": old,
        "new_role": new,
        "safe_to_restore": safe,
    }


def _extension(backend: SchedulerStandIn, *, event_driven: bool = True) -> PDExtension:
    """Event-driven: load changes wake the drain and polling is effectively off (60 s)."""
    if event_driven:
        extension = PDExtension(backend, idle_poll_interval=60.0)
        backend.notify = extension.load_changed
        return extension
    return PDExtension(backend, idle_poll_interval=0.01)


async def _until(condition, what: str) -> None:
    """Yield to the loop until `condition()` holds, bounded by WAIT seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0)


async def test_status_reports_role_port_load_epoch_and_start_time():
    backend = SchedulerStandIn("decode")
    backend.running, backend.waiting = 2, 1
    before = time.time()
    status = await _extension(backend).status()
    assert before - 1.0 <= status.pop("started_at") <= time.time()
    assert status == {
        "role": "decode",
        "bootstrap_port": BOOTSTRAP_PORT,
        "idle": False,
        "num_running": 2,
        "num_waiting": 1,
        "draining": False,
        "epoch": 0,
        "switch_supported": True,
    }


async def test_drain_closes_admission_and_undrain_reopens_it():
    extension = _extension(SchedulerStandIn())
    closed = await extension.set_drain({"drain": True})
    assert closed["draining"] is True
    assert extension.admits() is False
    reopened = await extension.set_drain({"drain": False})
    assert reopened["draining"] is False
    assert extension.admits() is True


async def test_drain_without_body_field_means_drain():
    extension = _extension(SchedulerStandIn())
    await extension.set_drain({})
    assert extension.draining is True


@pytest.mark.parametrize(
    ("body", "field"), [({"drain": "yes"}, "drain"), ({"drain": True, "force": 1}, "force")]
)
async def test_drain_body_errors_name_the_field(body, field):
    extension = _extension(SchedulerStandIn())
    with pytest.raises(ExtensionError) as refused:
        await extension.set_drain(body)
    assert refused.value.status == 400
    assert refused.value.body["field"] == field
    assert extension.admits() is True


async def test_convert_without_new_role_moves_to_the_other_role():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    status, reply = await extension.convert({})
    assert status == 200
    assert reply["success"] is True
    assert (reply["old_role"], reply["new_role"]) == ("prefill", "decode")
    assert reply["bootstrap_port"] == BOOTSTRAP_PORT
    assert reply["duration_s"] >= 0
    assert backend.role == "decode"
    assert extension.epoch == 1
    assert extension.admits() is True


async def test_convert_closes_admission_until_in_flight_finish_then_switches_on_load_event():
    backend = SchedulerStandIn("decode")
    extension = _extension(backend, event_driven=True)
    backend.start_request()
    conversion = asyncio.create_task(extension.convert({"new_role": "prefill"}))
    await _until(lambda: extension.draining, "admission to close")
    assert extension.admits() is False
    assert backend.switch_requests == []
    backend.finish_request()
    status, _ = await asyncio.wait_for(conversion, WAIT)
    assert status == 200
    assert backend.role == "prefill"
    assert extension.admits() is True


async def test_convert_notices_idleness_by_polling_when_backend_sends_no_load_events():
    backend = SchedulerStandIn("decode")
    extension = _extension(backend, event_driven=False)
    backend.start_request()
    conversion = asyncio.create_task(extension.convert({}))
    await _until(lambda: extension.draining, "admission to close")
    backend.finish_request()
    status, _ = await asyncio.wait_for(conversion, WAIT)
    assert status == 200
    assert backend.role == "prefill"


async def test_drain_timeout_fails_safely_and_reopens_admission():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    backend.start_request()
    status, reply = await asyncio.wait_for(extension.convert({"drain_timeout_secs": 0.05}), WAIT)
    assert status == 400
    assert reply["success"] is False
    assert reply["safe_to_restore"] is True
    assert "1 running" in reply["message"]
    assert backend.switch_requests == []
    assert backend.role == "prefill"
    assert extension.epoch == 0
    assert extension.admits() is True


async def test_second_conversion_while_one_runs_gets_409():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    backend.start_request()
    first = asyncio.create_task(extension.convert({}))
    await _until(lambda: extension.draining, "the first conversion to drain")
    status, reply = await extension.convert({})
    assert status == 409
    assert reply["success"] is False
    assert reply["safe_to_restore"] is True
    backend.finish_request()
    first_status, _ = await asyncio.wait_for(first, WAIT)
    assert first_status == 200


async def test_native_switch_while_a_conversion_runs_is_refused():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    backend.start_request()
    conversion = asyncio.create_task(extension.convert({}))
    await _until(lambda: extension.draining, "the conversion to drain")
    status, reply = await extension.switch({"new_role": "decode"})
    assert status == 400
    assert reply["success"] is False
    backend.finish_request()
    await asyncio.wait_for(conversion, WAIT)


async def test_convert_waits_again_when_a_request_reached_the_scheduler_after_the_idle_reading():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    backend.arrive_on_switch = 1
    conversion = asyncio.create_task(extension.convert({}))
    await _until(lambda: backend.switch_requests, "the first switch attempt")
    await _until(lambda: backend.running == 1, "the late request to arrive")
    assert extension.admits() is False
    backend.finish_request()
    status, _ = await asyncio.wait_for(conversion, WAIT)
    assert status == 200
    assert len(backend.switch_requests) == 2
    assert backend.role == "decode"


async def test_unsafe_switch_failure_keeps_admission_closed_and_refuses_later_conversions():
    backend = SchedulerStandIn("prefill")
    backend.teardown_fails = True
    extension = _extension(backend)
    status, reply = await extension.convert({})
    assert status == 400
    assert reply["safe_to_restore"] is False
    assert extension.failed is True
    assert extension.admits() is False
    again_status, again = await extension.convert({})
    assert again_status == 400
    assert again["safe_to_restore"] is False
    assert len(backend.switch_requests) == 1


async def test_convert_to_current_role_succeeds_without_draining_or_epoch_change():
    backend = SchedulerStandIn("decode")
    backend.start_request()
    extension = _extension(backend)
    status, reply = await extension.convert({"new_role": "decode"})
    assert status == 200
    assert reply["message"] == "already in target role"
    assert extension.epoch == 0
    assert extension.admits() is True


async def test_convert_is_refused_before_draining_when_switch_is_not_enabled():
    backend = SchedulerStandIn("prefill", switch_enabled=False)
    extension = _extension(backend)
    status, reply = await extension.convert({})
    assert status == 400
    assert reply["safe_to_restore"] is True
    assert backend.switch_requests == []
    assert extension.admits() is True


@pytest.mark.parametrize("new_role", ["Decode", "sideways", 5, ""])
async def test_native_switch_takes_only_the_exact_role_names(new_role):
    backend = SchedulerStandIn("prefill")
    with pytest.raises(ExtensionError) as refused:
        await _extension(backend).switch({"new_role": new_role})
    assert refused.value.body["field"] == "new_role"
    assert backend.switch_requests == []


async def test_native_switch_counts_role_changes_in_the_epoch_only():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    assert (await extension.switch({"new_role": "decode"}))[0] == 200
    status, reply = await extension.switch({"new_role": "decode"})
    assert status == 200
    assert (reply["old_role"], reply["new_role"]) == ("decode", "decode")
    assert extension.epoch == 1


async def test_native_switch_refusal_by_scheduler_is_a_400_reply():
    backend = SchedulerStandIn("prefill")
    backend.running = 1
    status, reply = await _extension(backend).switch({"new_role": "decode"})
    assert status == 400
    assert reply["safe_to_restore"] is True


async def test_native_switch_requires_new_role():
    with pytest.raises(ExtensionError) as refused:
        await _extension(SchedulerStandIn()).switch({})
    assert refused.value.body["field"] == "new_role"


async def test_convert_accepts_the_pr_9325_body():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    body = {
        "server_url": "http://127.0.0.1:30000",
        "disaggregation_mode": "decode",
        "check_idle": True,
        "disaggregation_bootstrap_port": BOOTSTRAP_PORT,
        "drain_timeout_secs": 5,
        "disable_cuda_graph": False,
    }
    status, reply = await extension.convert(body)
    assert status == 200
    assert reply["new_role"] == "decode"


async def test_convert_forwards_decode_graph_settings_to_the_native_switch():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    body = {"decode_cuda_graph_bs": [1, 2, 4], "decode_cuda_graph_memory_gb": 1.5}
    await extension.convert(body)
    assert backend.switch_requests == [
        {
            "new_role": "decode",
            "decode_cuda_graph_bs": [1, 2, 4],
            "decode_cuda_graph_memory_gb": 1.5,
        }
    ]


@pytest.mark.parametrize(
    "knob",
    ["disable_cuda_graph", "disable_radix_cache", "enable_hierarchical_cache", "tp_size"],
)
async def test_knobs_the_in_process_switch_cannot_honour_are_refused_naming_the_field(knob):
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    with pytest.raises(ExtensionError) as refused:
        await extension.convert({"new_role": "decode", knob: True})
    assert refused.value.status == 400
    assert refused.value.body["field"] == knob
    assert knob in refused.value.body["message"]
    assert backend.switch_requests == []
    assert extension.admits() is True


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"new_role": "both"}, "new_role"),
        ({"new_role": "decode", "disaggregation_mode": "prefill"}, "disaggregation_mode"),
        ({"drain_timeout_secs": -1}, "drain_timeout_secs"),
        ({"drain_timeout_secs": "10"}, "drain_timeout_secs"),
        ({"decode_cuda_graph_bs": [1, "2"]}, "decode_cuda_graph_bs"),
        ({"bootstrap_port": BOOTSTRAP_PORT + 1}, "bootstrap_port"),
        ({"new_role": "decode", "colour": "blue"}, "colour"),
        ({"check_idle": False}, "check_idle"),
    ],
)
async def test_convert_body_errors_name_the_field(body, field):
    backend = SchedulerStandIn("prefill")
    with pytest.raises(ExtensionError) as refused:
        await _extension(backend).convert(body)
    assert refused.value.status == 400
    assert refused.value.body["field"] == field
    assert backend.switch_requests == []


async def test_convert_body_must_be_an_object():
    with pytest.raises(ExtensionError) as refused:
        await _extension(SchedulerStandIn()).convert(["decode"])
    assert refused.value.status == 400


async def test_cancelled_conversion_reopens_admission():
    backend = SchedulerStandIn("prefill")
    extension = _extension(backend)
    backend.start_request()
    conversion = asyncio.create_task(extension.convert({}))
    await _until(lambda: extension.draining, "admission to close")
    conversion.cancel()
    with pytest.raises(asyncio.CancelledError):
        await conversion
    assert extension.admits() is True
    assert backend.role == "prefill"


class GenerationApp:
    """A raw ASGI app standing in for a server's routes: /generate holds until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["path"] == "/generate":
            self.entered += 1
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _gated(extension: PDExtension) -> tuple[GenerationApp, httpx.AsyncClient, InFlight]:
    app = GenerationApp()
    in_flight = InFlight()
    gate = AdmissionMiddleware(app, extension=extension, in_flight=in_flight)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://test")
    return app, client, in_flight


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_gate_answers_503_with_retry_after_to_generation_while_draining(path):
    extension = _extension(SchedulerStandIn())
    await extension.set_drain({"drain": True})
    _, client, _ = _gated(extension)
    async with client:
        response = await client.post(path, json={"text": "hi"})
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert "draining" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/health", "/pd_role", "/v1/loads", "/server_info"])
async def test_gate_lets_health_and_control_routes_through_while_draining(path):
    extension = _extension(SchedulerStandIn())
    await extension.set_drain({"drain": True})
    _, client, _ = _gated(extension)
    async with client:
        response = await client.get(path)
    assert response.status_code == 200


async def test_gate_honours_the_root_path_the_server_is_mounted_under():
    extension = _extension(SchedulerStandIn())
    await extension.set_drain({"drain": True})
    in_flight = InFlight()
    gate = AdmissionMiddleware(GenerationApp(), extension=extension, in_flight=in_flight)
    transport = httpx.ASGITransport(app=gate, root_path="/sglang")
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post("/sglang/generate", json={})
    assert response.status_code == 503


async def test_gate_counts_admitted_requests_until_answered():
    extension = _extension(SchedulerStandIn())
    app, client, in_flight = _gated(extension)
    async with client:
        request = asyncio.create_task(client.post("/generate", json={}))
        await _until(lambda: app.entered == 1, "the request to be admitted")
        assert in_flight.count == 1
        app.release.set()
        response = await asyncio.wait_for(request, WAIT)
    assert response.status_code == 200
    assert in_flight.count == 0


async def test_finishing_an_admitted_request_wakes_a_waiting_conversion():
    """The gate's own count is part of idleness: the conversion waits for the HTTP answer."""
    backend = SchedulerStandIn("prefill")
    extension = PDExtension(backend, idle_poll_interval=60.0)
    app, client, in_flight = _gated(extension)
    original_load = backend.load

    async def load_with_gate() -> Load:
        load = await original_load()
        idle = load.idle and in_flight.count == 0
        return Load(load.num_running, load.num_waiting + in_flight.count, idle)

    backend.load = load_with_gate
    async with client:
        request = asyncio.create_task(client.post("/generate", json={}))
        await _until(lambda: app.entered == 1, "the request to be admitted")
        conversion = asyncio.create_task(extension.convert({}))
        await _until(lambda: extension.draining, "admission to close")
        assert backend.switch_requests == []
        app.release.set()
        status, _ = await asyncio.wait_for(conversion, WAIT)
        await asyncio.wait_for(request, WAIT)
    assert status == 200
    assert backend.role == "decode"


async def test_health_answers_503_after_an_unsafe_switch_failure():
    backend = SchedulerStandIn("prefill")
    backend.teardown_fails = True
    extension = _extension(backend)
    await extension.convert({})
    _, client, _ = _gated(extension)
    async with client:
        health = await client.get("/health")
        generate = await client.post("/generate", json={})
    assert health.status_code == 503
    assert generate.status_code == 503


async def test_gate_answers_421_naming_the_live_role_to_a_request_sent_for_the_other_role():
    extension = _extension(SchedulerStandIn("prefill"))
    app, client, _ = _gated(extension)
    app.release.set()
    async with client:
        wrong = await client.post("/generate", json={}, headers={"X-PD-Role": "decode"})
        right = await client.post("/generate", json={}, headers={"X-PD-Role": "prefill"})
        unnamed = await client.post("/generate", json={})
    assert wrong.status_code == 421
    assert wrong.json()["role"] == "prefill"
    assert wrong.json()["error"]["code"] == 421
    assert (right.status_code, unnamed.status_code) == (200, 200)
    assert app.entered == 2


class CountingStandIn(SchedulerStandIn):
    """Counts how often the live role is read from the scheduler."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.role_reads = 0

    async def current_role(self) -> str:
        self.role_reads += 1
        return await super().current_role()


async def test_gate_reads_the_role_once_per_switch():
    backend = CountingStandIn("prefill")
    extension = _extension(backend)
    app, client, _ = _gated(extension)
    app.release.set()
    as_prefill = {"X-PD-Role": "prefill"}
    async with client:
        for _ in range(3):
            assert (await client.post("/generate", headers=as_prefill)).status_code == 200
        await extension.switch({"new_role": "decode"})
        for _ in range(3):
            moved = await client.post("/generate", headers=as_prefill)
            assert moved.status_code == 421 and moved.json()["role"] == "decode"
    # Once at the start and once after the switch (the live role, not what the reply claims).
    assert backend.role_reads == 2
