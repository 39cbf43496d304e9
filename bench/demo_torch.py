"""``make demo-torch``: the torch engine through pd-router, checked token for token.

Starts a 2P2D of ``pd-worker serve --engine torch`` (KV over mooncake's TransferEngine, or
``--kv-transfer tcp``) behind a real router process, sends a few prompts at once, compares every
output with what one colocated TorchModel generates for the same prompt, converts one prefill to
decode and back through the router (timing each conversion), and checks that every worker still
holds the same weight and KV pool tensors (``GET /torch_state``). Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from router_process import running_router  # noqa: E402

from pd_worker.cluster import WorkerCluster  # noqa: E402
from pd_worker.torch_engine.config import DEFAULT_MODEL_CONFIG, ModelConfig  # noqa: E402
from pd_worker.torch_engine.kv_pool import KVPool  # noqa: E402
from pd_worker.torch_engine.model import TorchModel  # noqa: E402
from pd_worker.torch_engine.tokenizer import build_tokenizer, encode  # noqa: E402

PROMPTS = (
    "The prefill computes the prompt's KV cache",
    "and the decode pulls it over the transfer engine",
    "before generating one token per step,",
    "several requests batched together.",
)
TOKENS = 12


def colocated(prompts: tuple[str, ...]) -> list[list[int]]:
    """What one colocated TorchModel generates for each prompt (the reference)."""
    config = ModelConfig.load(DEFAULT_MODEL_CONFIG)
    model = TorchModel(config, KVPool(config, 256, "cpu"), "cpu")
    tokenizer = build_tokenizer(config)
    return [model.generate(encode(tokenizer, prompt), TOKENS) for prompt in prompts]


async def generate(http: httpx.AsyncClient, prompt: str) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": TOKENS}}
    response = await http.post("/generate", json=body)
    response.raise_for_status()
    return response.json()


async def tensor_identities(http: httpx.AsyncClient, urls: list[str]) -> dict[str, tuple]:
    states = {url: (await http.get(url + "/torch_state")).json() for url in urls}
    return {
        u: (s["kv_pool_data_ptr"], sorted(s["weights_data_ptr"].items())) for u, s in states.items()
    }


async def convert(http: httpx.AsyncClient, url: str) -> float:
    started = time.perf_counter()
    response = await http.post("/convert_pd_role", json={"server_url": url}, timeout=60.0)
    response.raise_for_status()
    return time.perf_counter() - started


async def demo(router: str, cluster: WorkerCluster, expected: list[list[int]]) -> bool:
    ok = True
    async with httpx.AsyncClient(base_url=router, timeout=30.0) as http:
        before = await tensor_identities(http, cluster.urls)
        for round_name in ("2P2D", "after converting a prefill to decode and back"):
            replies = await asyncio.gather(*(generate(http, prompt) for prompt in PROMPTS))
            print(f"-- {len(PROMPTS)} requests at once, {round_name}")
            for prompt, reply, want in zip(PROMPTS, replies, expected, strict=True):
                same = reply["output_ids"] == want
                ok &= same
                source = reply["meta_info"].get("kv_source", "?")
                print(
                    f"{'same' if same else 'DIFFERENT'}  KV from {source}  {prompt!r} ->"
                    f" {reply['text']!r}"
                )
            if round_name == "2P2D":
                prefill = cluster.prefill_urls[0]
                there = await convert(http, prefill)
                back = await convert(http, prefill)
                print(f"-- converted {prefill} to decode in {there:.2f} s and back in {back:.2f} s")
        kept = await tensor_identities(http, cluster.urls) == before
        ok &= kept
        print(f"-- weights and KV pool data_ptr unchanged on every worker: {kept}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-transfer", choices=("mooncake", "tcp"), default="mooncake")
    args = parser.parse_args()
    expected = colocated(PROMPTS)
    with WorkerCluster(prefill=2, decode=2, engine="torch", kv_transfer=args.kv_transfer) as c:
        print(
            f"torch 2P2D, KV over {args.kv_transfer}: "
            + ", ".join(f"{w.role} {w.url}" for w in c.workers)
        )
        with running_router(c, drain_timeout_secs=30.0) as router:
            ok = asyncio.run(demo(router, c, expected))
    print("demo-torch: OK" if ok else "demo-torch: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
