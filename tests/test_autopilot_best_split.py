"""The autopilot finds the best split from a wrong one and holds it (issue 30, item 2), on real
processes: four reference workers behind a router and an open-loop load whose steady mix wants
2P2D, started from 1P3D and from 3P1D.

The mix: 14 requests a second of 200-token prompts (a prefill prefills a token in 0.5 ms: about
1,900 tokens a second, so the prefills need about 1.5 servers) and 36-token answers (a decode
step takes about 11 ms and a decode runs 4 requests at once: the decodes need about 1.4). At
1P3D the prefill is short, at 3P1D the decode; at 2P2D both serve with room, and no move from
there would leave its donor under 90% of the servers it keeps."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conversion_helpers import pools
from tests.open_load import OpenLoad
from tests.router_helpers import running_router, wait_until

TIMING = {"speed": 1.0, "prefill_secs_per_token": 0.0005, "max_running_requests": 4}
TOKENS = 36
RATE = 14.0
AUTOPILOT = {
    "mode": "auto",
    "interval_secs": 0.2,
    "window_secs": 1.0,
    "sustain_secs": 0.6,
    "cooldown_secs": 1.0,
    "flip_guard_secs": 60.0,
    "peak_secs": 3.0,
}
HOLD_SECS = 6.0


async def split(http: httpx.AsyncClient) -> tuple[int, int]:
    current = await pools(http)
    return len(current["prefill"]), len(current["decode"])


@pytest.mark.parametrize("start", [(1, 3), (3, 1)], ids=["from 1P3D", "from 3P1D"])
async def test_a_steady_mix_reaches_the_best_split_and_holds_it(cluster_factory, start):
    cluster = cluster_factory(prefill=start[0], decode=start[1], **TIMING)
    async with (
        running_router(cluster, autopilot=AUTOPILOT) as router,
        router.client() as http,
        OpenLoad(router.url, RATE, TOKENS) as load,
    ):

        async def balanced() -> bool:
            return await split(http) == (2, 2)

        try:
            await wait_until(balanced, within=45.0, what="the autopilot reached 2P2D")
        except AssertionError:
            state = (await http.get("/autopilot")).json()
            raise AssertionError((state["last_decision"]["reason"], state["loads"])) from None
        held_until = time.monotonic() + HOLD_SECS
        while time.monotonic() < held_until:
            assert await split(http) == (2, 2)
            await asyncio.sleep(0.2)
        records = (await http.get("/conversions")).json()["conversions"]
        state = (await http.get("/autopilot")).json()
    assert len(records) == 1, [d["reason"] for d in state["decisions"]]
    assert load.failed == []
    assert len(load.statuses) > RATE * HOLD_SECS
