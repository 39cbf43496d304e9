"""The router's control side against real SGLang 0.5.23 servers: a switch made on a server behind
the router's back is followed, the autopilot converts a real server when the load shifts, and
server_patch's extension endpoints are answered by a real SGLang process."""

from __future__ import annotations

import concurrent.futures
import json
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
    # reached the router before the scheduler released them).
    eventually(lambda: pd_role()["idle"], 30, "the decode idle")
    role = pd_role()
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


# Prompts of about 400 tokens, sent open-loop at 1.4 times what the two prefills prefill (read
# from SGLang's own counters after a warm-up): the prefills fall short of the arrivals, while
# the decodes (8-token answers) hold little; the one decode left after the conversion holds a
# few of these in its 4096 KV tokens. No more than OUTSTANDING at once, so that a slow machine
# is not buried (a decode that misses a CPU-starved prefill's heartbeats fails its rooms).
OVERLOAD = 1.4
OUTSTANDING = 6


def prefill_speed(servers: list[SGLangServer]) -> float:
    """Prompt tokens per second of forward time, from SGLang's /v1/loads counters."""
    tokens = busy_us = 0
    for server in servers:
        for rank in httpx.get(server.url + "/v1/loads", timeout=10).json()["loads"]:
            tokens += rank.get("total_prefill_uncached_tokens", 0)
            busy_us += rank.get("total_prefill_busy_us", 0)
    assert busy_us > 0, "SGLang reported no prefill forward time"
    return tokens / (busy_us / 1e6)


def test_the_autopilot_converts_a_real_server_when_prompts_grow(
    sglang_fleet: Fleet, tmp_path: Path
) -> None:
    """Long prompts at a rate two prefills cannot keep up with: the autopilot in auto mode, by
    the capacity SGLang's counters report, moves a decode to the prefill pool, through a real
    drain and switch."""
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
        warm = [generate(router.url, f"warm {i} {long_prompt}") for i in range(4)]
        prompt_tokens = warm[-1].json()["meta_info"]["prompt_tokens"]
        rate = OVERLOAD * 2 * prefill_speed(sglang_fleet.prefill) / prompt_tokens

        def converted() -> bool:
            records = httpx.get(router.url + "/conversions", timeout=10).json()["conversions"]
            return any(r["status"] == "succeeded" for r in records)

        failures: list[str] = []
        answered = 0
        deadline = time.monotonic() + 150
        with concurrent.futures.ThreadPoolExecutor(OUTSTANDING) as pool:
            running: set[concurrent.futures.Future[httpx.Response]] = set()
            started, sent = time.monotonic(), 0
            while time.monotonic() < deadline and not converted():
                if len(running) < OUTSTANDING and time.monotonic() >= started + sent / rate:
                    running.add(pool.submit(generate, router.url, f"{sent} {long_prompt}"))
                    sent += 1
                done = {f for f in running if f.done()}
                running -= done
                for future in done:
                    answered += 1
                    reply = future.result()
                    if reply.status_code != 200:
                        failures.append(f"{reply.status_code}: {reply.text[:300]}")
                time.sleep(0.02)
            for future in concurrent.futures.as_completed(running):
                answered += 1
                reply = future.result()
                if reply.status_code != 200:
                    failures.append(f"{reply.status_code}: {reply.text[:300]}")
        httpx.put(router.url + "/autopilot", json={"mode": "off"}, timeout=10)
        records = httpx.get(router.url + "/conversions", timeout=10).json()["conversions"]
        moved = next((r for r in records if r["status"] == "succeeded"), None)
        back = None
        if moved is not None:
            # Back to 2P2D for the tests after this one, whatever this one found.
            back = httpx.post(
                router.url + "/convert_pd_role",
                json={"server_url": moved["worker_url"], "new_role": moved["from_role"]},
                timeout=TIMEOUT,
            )
        autopilot = httpx.get(router.url + "/autopilot", timeout=10).json()
        seen = {k: autopilot[k] for k in ("last_decision", "last_error", "loads", "last_sample")}
        assert moved is not None, json.dumps(seen)
        assert (moved["from_role"], moved["to_role"]) == ("decode", "prefill"), moved
        decided = [d for d in autopilot["decisions"] if d["action"] != "hold"]
        assert decided[-1]["reason"].startswith("prefill needs "), decided[-1]["reason"]
        legs = [line for line in router.log().splitlines() if "leg failed" in line]
        assert failures == [], (answered, failures[:5], legs[-10:])
        assert back is not None and back.status_code == 200, back and back.text
