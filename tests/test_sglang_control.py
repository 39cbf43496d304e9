"""The router's control side against real SGLang 0.5.23 servers: a switch made on a server behind
the router's back is followed, the autopilot reckons each pool's need from SGLang's own capacity
counters (holding while the pools keep up, converting a real prefill when the decodes fall
short), and server_patch's extension endpoints are answered by a real SGLang process."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cli_process import Served, serving
from tests.sglang_cluster import Fleet, SGLangServer, eventually, router_ready

pytestmark = pytest.mark.real_sglang

TIMEOUT = 120.0
GREEDY = {"temperature": 0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def router(sglang_fleet: Fleet) -> Iterator[Served]:
    args = [*sglang_fleet.router_args(), "--host", "127.0.0.1"]
    args += ["--health-check-interval-secs", "1"]
    with serving(*args) as served:
        router_ready(served.url, prefill=2, decode=2)
        yield served


def generate(url: str, prompt: str = "The quick brown fox", **extra: Any) -> httpx.Response:
    body = {"text": prompt, "sampling_params": GREEDY, **extra}
    return httpx.post(url + "/generate", json=body, timeout=TIMEOUT)


def router_role(router: Served, server: SGLangServer) -> str | None:
    workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return next((w["role"] for w in workers if w["url"] == server.url), None)


def native_switch(server: SGLangServer, role: str) -> dict[str, Any]:
    reply = server.switch(role)
    assert reply["success"], reply
    return reply


def test_a_switch_made_on_the_server_is_followed(sglang_fleet: Fleet, router: Served) -> None:
    """SGLang's own /pd_role_switch on an idle decode: the router reads the new role from the
    server, routes to it as a prefill, and follows it back."""
    d0 = sglang_fleet.decode[0]
    native_switch(d0, "prefill")
    eventually(lambda: router_role(router, d0) == "prefill", 30, "router follows to prefill")
    router_ready(router.url, prefill=3, decode=1)
    for _ in range(6):
        assert generate(router.url).status_code == 200
    native_switch(d0, "decode")
    eventually(lambda: router_role(router, d0) == "decode", 30, "router follows back")
    router_ready(router.url, prefill=2, decode=2)
    for _ in range(6):
        assert generate(router.url).status_code == 200


def test_extension_endpoints_answered_by_real_sglang(sglang_fleet: Fleet) -> None:
    """server_patch's routes on a real SGLang process (launched by server_patch.launch_server,
    which also added nothing the command line lacked: --enable-pd-role-switch was given)."""
    d1 = sglang_fleet.decode[1]

    def pd_role() -> dict[str, Any]:
        return httpx.get(d1.url + "/pd_role", timeout=10).json()

    # The requests of the tests before may still be finishing on the decode (their answers
    # reached the router before the scheduler released them), and the module's router keeps
    # probing it (SGLang's /health is a generation): the reading checked is the idle one.
    readings: list[dict[str, Any]] = []

    def idle() -> bool:
        readings.append(pd_role())
        return bool(readings[-1]["idle"])

    eventually(idle, 30, "the decode idle")
    role = readings[-1]
    assert role["role"] == "decode" and role["idle"] and role["switch_supported"]
    assert role["bootstrap_port"] == d1.bootstrap_port
    epoch = role["epoch"]

    drained = httpx.post(d1.url + "/pd_drain", json={"drain": True}, timeout=10).json()
    assert drained["draining"]
    refused = generate(d1.url)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert not httpx.post(d1.url + "/pd_drain", json={"drain": False}, timeout=10).json()[
        "draining"
    ]

    wrong = httpx.post(
        d1.url + "/generate",
        json={"text": "x", "sampling_params": GREEDY},
        headers={"X-PD-Role": "prefill"},
        timeout=TIMEOUT,
    )
    assert wrong.status_code == 421 and wrong.json()["role"] == "decode"

    converted = httpx.post(
        d1.url + "/convert_pd_role", json={"new_role": "prefill"}, timeout=TIMEOUT
    ).json()
    assert converted["success"] and converted["new_role"] == "prefill", converted
    assert (
        httpx.get(d1.url + "/server_info", timeout=10).json()["internal_states"][0][
            "disaggregation_mode"
        ]
        == "prefill"
    )
    # Straight after the switch the module's router probes d1 as a new prefill, and SGLang's
    # /health is a generation: the switch back waits for it.
    native_switch(d1, "decode")
    assert pd_role()["epoch"] == epoch + 2

    p0 = sglang_fleet.prefill[0]
    forgot = httpx.post(
        d1.url + "/pd_forget_prefill",
        json={"bootstrap_host": "127.0.0.1", "bootstrap_port": p0.bootstrap_port},
        timeout=TIMEOUT,
    )
    assert forgot.status_code == 200, forgot.text


# Prompts of about 400 tokens, open-loop, no more than OUTSTANDING at once (a decode that
# misses a CPU-starved prefill's heartbeats fails its rooms). On two shared cores a request's
# time is mostly not its prefill forward (measured: the prefills read 0.84 of 2 needed, 4,590
# prompt tokens a second arriving against 5,480 each prefill prefills per second of forward
# time), so the prefills keep up and the autopilot, by capacity, rightly converts nothing.
OUTSTANDING = 6
LOAD_SECS = 12.0


def test_the_autopilot_reads_real_sglangs_capacity_and_holds_while_the_pools_keep_up(
    sglang_fleet: Fleet, tmp_path: Path
) -> None:
    """SGLang 0.5.23's /v1/loads capacity counters reach the autopilot: each pool's need is
    reckoned from them (a prefill's prompt tokens per second of forward time, the decodes' batch
    and KV), and with both pools keeping up it holds, saying so."""
    config = tmp_path / "router.toml"
    config.write_text(
        "[autopilot]\n"
        'mode = "auto"\n'
        "interval_secs = 0.5\nwindow_secs = 3.0\nsustain_secs = 2.0\ncooldown_secs = 600.0\n"
    )
    args = [*sglang_fleet.router_args(), "--host", "127.0.0.1", "--config", str(config)]
    args += ["--health-check-interval-secs", "1"]
    long_prompt = " ".join(f"word{i} of a prompt" for i in range(80))
    with serving(*args) as router:
        router_ready(router.url, prefill=2, decode=2)
        failures: list[str] = []
        with concurrent.futures.ThreadPoolExecutor(OUTSTANDING) as pool:
            replies = [
                pool.submit(generate, router.url, f"{i} {long_prompt}")
                for i in range(int(LOAD_SECS * OUTSTANDING))
            ]
            deadline = time.monotonic() + LOAD_SECS
            while time.monotonic() < deadline and not all(r.done() for r in replies):
                time.sleep(0.5)
            autopilot = httpx.get(router.url + "/autopilot", timeout=10).json()
            for reply in replies:
                reply.cancel()
            for reply in replies:
                if not reply.cancelled() and reply.result().status_code != 200:
                    failures.append(reply.result().text[:300])
        records = httpx.get(router.url + "/conversions", timeout=10).json()["conversions"]
    prefill, decode = autopilot["loads"]["prefill"], autopilot["loads"]["decode"]
    assert prefill["need"] is not None and decode["need"] is not None, autopilot["loads"]
    speed = float(prefill["basis"].split("a prefill prefills ")[1].split(" ")[0])
    assert speed > 0, prefill["basis"]
    assert "within target" in decode["basis"], decode["basis"]
    assert autopilot["last_decision"]["action"] == "hold", autopilot["last_decision"]
    assert records == [] and failures == []


# Prompts of about 190 tokens and answers of ANSWER_TOKENS (ignore_eos), ANSWERING clients each
# sending its next request when the last is answered: the decodes' KV fills while the prefills
# idle (measured here: the decodes held 60-70% of one decode's 4096 KV tokens, the prefills
# needed 0.1-0.3 of one). SGLang's KV pool on the CPU is small, so the autopilot's KV target is
# set low (decode_kv_usage 0.15): a dozen answers make the decodes short of it long before the
# pool itself fills (a full pool on two CPU cores retracts and starves the servers).
ANSWERING = 12
ANSWER_TOKENS = 400


def test_the_autopilot_converts_a_real_prefill_when_the_decodes_fall_short(
    sglang_fleet: Fleet, tmp_path: Path
) -> None:
    """With answers holding more KV than two decodes carry at target, the autopilot, reading
    SGLang's own counters, moves a prefill to the decode pool (2P2D -> 1P3D) through a real
    role switch; no request fails, and SGLang reports the new role."""
    config = tmp_path / "router.toml"
    config.write_text(
        "[autopilot]\n"
        'mode = "auto"\n'
        "interval_secs = 0.5\nwindow_secs = 3.0\nsustain_secs = 2.0\ncooldown_secs = 600.0\n"
        "peak_secs = 3.0\ndecode_kv_usage = 0.15\n"
    )
    args = [*sglang_fleet.router_args(), "--host", "127.0.0.1", "--config", str(config)]
    args += ["--health-check-interval-secs", "1"]
    sampling = {"temperature": 0, "max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}
    story = " ".join(f"word{i} of a story" for i in range(25))
    with serving(*args) as router:
        router_ready(router.url, prefill=2, decode=2)
        failures: list[str] = []

        def answer(i: int) -> None:
            body = {"text": f"{i} {story}", "sampling_params": sampling}
            reply = httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT)
            if reply.status_code != 200:
                failures.append(f"{reply.status_code} {reply.text[:300]}")

        def converted() -> list[dict[str, Any]]:
            records = httpx.get(router.url + "/conversions", timeout=10).json()["conversions"]
            return [r for r in records if r["status"] == "succeeded"]

        with concurrent.futures.ThreadPoolExecutor(ANSWERING) as pool:
            sent = [pool.submit(answer, i) for i in range(ANSWERING)]
            deadline = time.monotonic() + 90.0
            i = ANSWERING
            while time.monotonic() < deadline and not converted():
                done = [f for f in sent if f.done()]
                for finished in done:
                    sent.remove(finished)
                    sent.append(pool.submit(answer, i))
                    i += 1
                time.sleep(0.2)
            autopilot = httpx.get(router.url + "/autopilot", timeout=10).json()
            records = converted()
        roles = {s.url: s.role() for s in sglang_fleet.pd}
    # The fleet goes back to 2P2D before anything is asserted: the tests after this one share it.
    # The moved prefill's way back is a round trip, so the decodes forget its old endpoint.
    sglang_fleet.restore_roles()
    sglang_fleet.refresh_decodes()
    assert failures == []
    assert records, (autopilot["last_decision"], autopilot["loads"])
    (record,) = records
    assert (record["from_role"], record["to_role"]) == ("prefill", "decode")
    assert record["started_by"] == "autopilot"
    decision = autopilot["decisions"][0]
    assert decision["action"] == "prefill_to_decode", decision
    assert "KV" in decision["reason"], decision["reason"]
    assert roles[record["worker_url"]] == "decode"
