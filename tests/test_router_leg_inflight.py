"""In-flight accounting per leg, through a real router and reference workers: a prefill counts a
request in flight only until it answered (the decode has pulled its KV by then), so a prefill
can be drained and converted while the decodes still stream the answers it prefilled."""

from __future__ import annotations

import asyncio

import pytest

from tests.conversion_helpers import convert
from tests.router_helpers import running_router, wait_until

# A prefill forward takes 0.3 s (long enough to see which prefill has the request), an answer
# of 60 tokens 3 s of 50 ms decode steps.
TIMING = {"speed": 1.0, "prefill_batch_overhead_secs": 0.3, "decode_step_base_secs": 0.05}
STREAM = {"text": "a long answer", "sampling_params": {"max_new_tokens": 60}, "stream": True}


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory(prefill=2, decode=1, **TIMING)


async def test_a_prefill_that_answered_is_out_of_flight_and_converts_while_its_decode_streams(
    cluster,
):
    async with running_router(cluster) as router, router.client() as http:
        registry = router.state.registry
        stream = asyncio.create_task(http.post("/generate", json=STREAM))

        def busy_prefill() -> str | None:
            return next((u for u in cluster.prefill_urls if registry.get(u).inflight), None)

        await wait_until(busy_prefill, 5.0, what="the request in flight on a prefill")
        prefill = busy_prefill()
        decode = registry.get(cluster.decode_urls[0])
        await wait_until(
            lambda: registry.get(prefill).inflight == 0 and decode.inflight == 1,
            5.0,
            what="the prefill answered while the decode streams",
        )
        converted = await convert(http, server_url=prefill, new_role="decode")
        assert converted.status_code == 200, converted.text
        assert converted.json()["status"] == "succeeded"
        assert not stream.done()
        response = await stream
    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")
