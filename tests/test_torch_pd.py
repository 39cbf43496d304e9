"""The torch engine through a real router: a 2P2D of ``pd-worker serve --engine torch`` moves real
KV tensors over mooncake's TransferEngine, and every disaggregated output equals, token for token,
what one colocated TorchModel generates for the same prompt; role conversions under load keep
the weights and the KV pool (same data_ptr); a prefill that dies after publishing a room's KV
fails that request alone; the plain-TCP transport, chosen by flag, moves the same KV."""

from __future__ import annotations

import asyncio
import itertools
import re

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the torch engine needs the torch extra")
pytest.importorskip("mooncake.engine", reason="the KV transport needs mooncake-transfer-engine")

from pd_worker.cli import TORCH_KV_SLOTS  # noqa: E402
from pd_worker.torch_engine.config import DEFAULT_MODEL_CONFIG, ModelConfig  # noqa: E402
from pd_worker.torch_engine.kv_pool import KVPool  # noqa: E402
from pd_worker.torch_engine.model import TorchModel  # noqa: E402
from pd_worker.torch_engine.tokenizer import build_tokenizer, encode  # noqa: E402
from tests.conversion_helpers import arrange, convert, live_roles, pools  # noqa: E402
from tests.router_helpers import (  # noqa: E402
    fault,
    running_router,
    sse_events,
    wait_until,
)

TOKENS = 6
PROMPTS = [f"prompt number {n}: the kv cache moves" for n in range(6)]


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of a colocated TorchModel, by prompt."""
    config = ModelConfig.load(DEFAULT_MODEL_CONFIG)
    model = TorchModel(config, KVPool(config, 512, "cpu"), "cpu")
    tokenizer = build_tokenizer(config)
    cache: dict[str, list[int]] = {}

    def outputs(prompt: str) -> list[int]:
        if prompt not in cache:
            cache[prompt] = model.generate(encode(tokenizer, prompt), TOKENS)
        return cache[prompt]

    return outputs


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=2, decode=2, engine="torch", kv_transfer="mooncake")


@pytest.fixture(scope="module")
def tcp_cluster(module_cluster_factory):
    """A 1P1D moving KV over plain TCP: the fallback's own pair, and a decode on another
    transport than the mooncake cluster's prefills."""
    return module_cluster_factory(prefill=1, decode=1, engine="torch", kv_transfer="tcp")


@pytest.fixture
async def router(cluster):
    prefill, decode = await live_roles(cluster)
    async with running_router(cluster, prefill=prefill, decode=decode) as r:
        async with r.client() as http:
            await arrange(http, prefill=2)
        yield r


async def generated_ids(http: httpx.AsyncClient, prompt: str, *, stream: bool) -> list[int]:
    """The token ids the router returns for ``prompt`` (the last event of a stream)."""
    body = {"text": prompt, "sampling_params": {"max_new_tokens": TOKENS}, "stream": stream}
    response = await http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["output_ids"]
    events = sse_events(response.text)
    assert events[-1] == "[DONE]", response.text[-300:]
    return events[-2]["output_ids"]


async def torch_states(urls: list[str]) -> dict[str, dict]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return {url: (await http.get(url + "/torch_state")).json() for url in urls}


def tensor_identity(state: dict) -> tuple:
    return state["kv_pool_data_ptr"], sorted(state["weights_data_ptr"].items())


# glog's ERROR lines (mooncake's C++ logging): E, month and day, then the time.
GLOG_ERROR = re.compile(r"^E\d{4} ", re.MULTILINE)


def test_torch_workers_start_without_a_numpy_warning_or_an_error_line(cluster):
    for worker in cluster.workers:
        log = worker.log_path.read_text()
        assert "NumPy" not in log, log
        assert GLOG_ERROR.search(log) is None, log


async def test_disaggregated_batch_equals_colocated_generate_token_for_token(
    router, cluster, reference
):
    assert {s["transport"] for s in (await torch_states(cluster.urls)).values()} == {"mooncake"}
    async with router.client() as http:
        outputs = await asyncio.gather(
            *(generated_ids(http, prompt, stream=n % 2 == 0) for n, prompt in enumerate(PROMPTS))
        )
    assert outputs == [reference(prompt) for prompt in PROMPTS]
    await wait_until(lambda: all_slots_free(cluster), what="every worker freed its slots")


async def test_aborted_streams_free_their_slots_on_both_sides(router, cluster):
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 500}, "stream": True}
    async with router.client() as http:
        for _ in range(2):
            async with http.stream("POST", "/generate", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        break
    await wait_until(lambda: all_slots_free(cluster), what="every worker freed its slots")


async def test_conversions_under_load_keep_outputs_and_tensors(router, cluster, reference):
    before = await torch_states(cluster.urls)
    failures: list[str] = []
    answered: list[str] = []
    done = asyncio.Event()
    counter = itertools.count()

    async def client(http: httpx.AsyncClient) -> None:
        while not done.is_set():
            prompt = PROMPTS[next(counter) % len(PROMPTS)]
            try:
                ids = await generated_ids(http, prompt, stream=bool(next(counter) % 2))
            except (AssertionError, httpx.HTTPError) as exc:
                failures.append(f"{prompt}: {exc}")
                continue
            answered.append(prompt)
            if ids != reference(prompt):
                failures.append(f"{prompt}: {ids} != {reference(prompt)}")

    async with router.client() as http:
        clients = [asyncio.create_task(client(http)) for _ in range(4)]
        try:
            for _ in range(2):
                prefill = (await pools(http))["prefill"][0]
                assert (await convert(http, server_url=prefill)).status_code == 200
                decode = (await pools(http))["decode"][0]
                assert (await convert(http, server_url=decode)).status_code == 200
        finally:
            done.set()
            await asyncio.gather(*clients)
    after = await torch_states(cluster.urls)
    assert failures == []
    assert len(answered) >= 8
    assert {u: tensor_identity(s) for u, s in after.items()} == {
        u: tensor_identity(s) for u, s in before.items()
    }


async def test_prefill_dying_after_publishing_kv_fails_that_request_and_decode_keeps_serving(
    cluster, module_cluster_factory, reference
):
    doomed_cluster = module_cluster_factory(
        prefill=1, decode=0, engine="torch", kv_transfer="mooncake"
    )
    doomed = doomed_cluster.prefill_urls[0]
    prefills, decodes = await live_roles(cluster)
    spare, decode = prefills[0], decodes[0]
    slots = (await torch_states([decode]))[decode]["free_slots"]
    await fault(doomed, exit_after_kv_publish=True)
    async with (
        running_router(
            prefill=[(doomed, doomed_cluster.bootstrap_port(doomed))], decode=[decode]
        ) as r,
        r.client() as http,
    ):
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": TOKENS}}
        failed = await http.post("/generate", json=body)
    # Whichever leg the router hears from first: the decode's failed read or the dead prefill.
    error = failed.json()["error"]
    assert (failed.status_code, error["type"]) == (502, "upstream_error")
    assert error["message"].startswith(f"prefill worker {doomed}") or (
        error["message"].startswith(f"decode worker {decode}")
        and "KV transfer failed" in error["message"]
    ), error["message"]
    async with (
        running_router(prefill=[(spare, cluster.bootstrap_port(spare))], decode=[decode]) as r,
        r.client() as http,
    ):
        assert await generated_ids(http, PROMPTS[1], stream=False) == reference(PROMPTS[1])
    await wait_until(
        lambda: _free_slots(decode, slots), within=10.0, what="the decode freed every slot"
    )


async def all_slots_free(cluster) -> bool:
    states = await torch_states(cluster.urls)
    return all(state["free_slots"] == TORCH_KV_SLOTS for state in states.values())


async def _free_slots(url: str, expected: int) -> bool:
    return (await torch_states([url]))[url]["free_slots"] == expected


async def test_decode_on_another_kv_transfer_than_its_prefill_fails_saying_so(cluster, tcp_cluster):
    prefill = (await live_roles(cluster))[0][0]
    async with (
        running_router(prefill=[prefill], decode=tcp_cluster.decode_urls) as r,
        r.client() as http,
    ):
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": TOKENS}}
        failed = await http.post("/generate", json=body)
    assert failed.status_code == 502
    message = failed.json()["error"]["message"]
    assert f"the prefill {prefill} moves KV over mooncake but this decode over tcp" in message
    assert "start every worker with the same --kv-transfer" in message


async def test_plain_tcp_fallback_moves_the_same_kv(tcp_cluster, reference):
    assert {s["transport"] for s in (await torch_states(tcp_cluster.urls)).values()} == {"tcp"}
    async with running_router(tcp_cluster) as r, r.client() as http:
        outputs = await asyncio.gather(
            *(generated_ids(http, prompt, stream=n % 2 == 1) for n, prompt in enumerate(PROMPTS))
        )
    assert outputs == [reference(prompt) for prompt in PROMPTS]
