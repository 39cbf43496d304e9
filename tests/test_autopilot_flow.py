"""The autopilot in a real router over reference workers: prompt traffic arriving on a 1P2D
cluster makes it convert a decode into a prefill while an open-loop load keeps coming (no
failed request); recommend mode decides the same and changes nothing; ``GET``/``PUT /autopilot``."""

from __future__ import annotations

import asyncio
import io

import pytest

from pd_router.cli.admin_client import autopilot
from tests.conversion_helpers import pools, sample
from tests.open_load import OpenLoad
from tests.router_helpers import running_router, wait_until

# 14 prompts a second of about 200 tokens each, a token taking 0.5 ms to prefill: the one
# prefill, which prefills about 1,900 tokens a second, is short by half, while the decodes hold
# a few 8-token answers in their batch slots. From the workers' counters the prefill pool needs
# a second server and the decode pool can give one.
TIMING = {"speed": 1.0, "prefill_secs_per_token": 0.0005}
RATE = 14.0
TOKENS = 8
AUTOPILOT = {
    "mode": "auto",
    "interval_secs": 0.2,
    "window_secs": 1.0,
    "sustain_secs": 0.6,
    "cooldown_secs": 60.0,
    "tpot_slo_ms": 200.0,
    "decode_kv_usage": 0.9,
}
ADMIN_KEY = "autopilot-admin"
# The model the reference workers serve by default (their /server_info names it).
TOY_MODEL = "pd-worker/toy-model"


async def split(http) -> tuple[int, int]:
    """(prefills, decodes) ACTIVE in the router."""
    current = await pools(http)
    return len(current["prefill"]), len(current["decode"])


async def has_split(http, wanted: tuple[int, int]) -> bool:
    return await split(http) == wanted


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(prefill=1, decode=2, **TIMING)


async def test_prompt_traffic_makes_the_autopilot_convert_a_decode_with_no_failed_request(
    cluster,
):
    async with running_router(cluster, autopilot=AUTOPILOT) as router, router.client() as http:
        assert (await pools(http))["decode"] == cluster.decode_urls
        async with OpenLoad(router.url, RATE, TOKENS) as load:
            await wait_until(
                lambda: has_split(http, (2, 1)), within=20.0, what="a decode became a prefill"
            )
            await asyncio.sleep(20 / RATE)
        assert load.failed == []
        state = (await http.get("/autopilot")).json()
        converted = [d for d in state["decisions"] if d["action"] != "hold"]
        assert [(d["action"], d["applied"]) for d in converted] == [("decode_to_prefill", True)]
        assert converted[0]["reason"].startswith("prefill needs ")
        assert "prompt tokens/s arriving" in converted[0]["reason"]
        assert converted[0]["worker"] in cluster.decode_urls
        assert await split(http) == (2, 1)
        action = {"action": "decode_to_prefill"}
        assert await sample(http, "pd_router_autopilot_decisions_total", **action) == 1.0
        desired = await sample(
            http, "pd_router_autopilot_desired_workers", role="prefill", model=TOY_MODEL
        )
        assert desired == 2.0
        (record,) = (await http.get("/conversions")).json()["conversions"]
        assert (record["started_by"], record["replica"]) == ("autopilot", None)


async def test_recommend_mode_decides_and_changes_nothing(cluster):
    config = {**AUTOPILOT, "mode": "recommend"}
    async with running_router(cluster, autopilot=config) as router, router.client() as http:
        async with OpenLoad(router.url, RATE, TOKENS) as load:
            await wait_until(
                lambda: any(d.converts for d in router.state.autopilot.decisions),
                within=20.0,
                what="a recommendation",
            )

            async def sampled_latencies() -> bool:
                # Streams whose events reached the router at once (a busy loop) measure 0 s/token.
                sample = (await http.get("/autopilot")).json()["last_sample"]
                return sample["prefill_p90_ms"] is not None and bool(sample["tpot_p90_ms"])

            await wait_until(sampled_latencies, within=10.0, what="a sample with latencies")
            state = (await http.get("/autopilot")).json()
        assert load.failed == []
        recommended = next(d for d in state["decisions"] if d["action"] != "hold")
        assert (recommended["action"], recommended["applied"]) == ("decode_to_prefill", False)
        seen = state["last_sample"]
        assert seen["prefill_p90_ms"] >= 50.0 and seen["tpot_p90_ms"] > 0.0
        assert 0.0 <= seen["decode_wait_p90_ms"] < seen["prefill_p90_ms"]
        assert {w["url"] for w in seen["workers"]} == {*cluster.prefill_urls, *cluster.decode_urls}
        assert (await http.get("/conversions")).json()["conversions"] == []
        assert (await pools(http))["decode"] == cluster.decode_urls
        shown = (await http.get("/status")).json()["autopilot"]
        assert shown["mode"] == "recommend"
        assert shown["decisions"][0]["reason"] == recommended["reason"]
        assert 'id="autopilot"' in (await http.get("/dashboard")).text


async def test_the_autopilot_command_sets_the_mode_and_prints_loads_and_decisions(cluster):
    async with running_router(cluster, autopilot={**AUTOPILOT, "mode": "off"}) as router:
        out = io.StringIO()
        argv = ["--router", router.url, "--mode", "recommend"]
        async with OpenLoad(router.url, RATE, TOKENS) as load:
            assert await asyncio.to_thread(autopilot, argv, out) == 0
            await wait_until(
                lambda: any(d.converts for d in router.state.autopilot.decisions),
                within=20.0,
                what="a recommendation",
            )
        assert load.failed == []
        assert out.getvalue().startswith("autopilot: recommend  (prefill_queue_tokens=8192.0, ")
        out = io.StringIO()
        assert await asyncio.to_thread(autopilot, ["--router", router.url], out) == 0
        text = out.getvalue()
        assert "role     workers  needs  measure" in text and "prefill  1  " in text
        assert "decode_to_prefill" in text and "recommended  prefill needs " in text


async def test_put_autopilot_changes_mode_and_targets_with_the_admin_key(cluster):
    async with running_router(cluster, admin_api_key=ADMIN_KEY) as router:
        async with router.client() as anonymous:
            assert (await anonymous.get("/autopilot")).status_code == 401
            assert (await anonymous.put("/autopilot", json={"mode": "auto"})).status_code == 401
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with router.client(headers=headers) as http:
            assert (await http.get("/autopilot")).json()["mode"] == "off"
            reply = await http.put("/autopilot", json={"mode": "recommend", "ttft_slo_ms": 300})
            assert reply.status_code == 200, reply.text
            assert reply.json()["mode"] == "recommend"
            assert reply.json()["config"]["ttft_slo_ms"] == 300.0
            bad = await http.put("/autopilot", json={"mode": "sometimes"})
            assert bad.status_code == 400
            assert bad.json()["error"]["field"] == "autopilot.mode"
            assert (await http.get("/autopilot")).json()["mode"] == "recommend"


async def test_every_decision_series_is_exported_at_zero_before_the_first_decision(cluster):
    async with running_router(cluster) as router, router.client() as http:
        for action in ("hold", "prefill_to_decode", "decode_to_prefill"):
            assert await sample(http, "pd_router_autopilot_decisions_total", action=action) == 0.0
