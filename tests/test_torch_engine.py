"""The torch engine's model, KV pool and tokenizer, in process (pure computation, no servers).

The properties the disaggregated path rests on: prefill then decode steps over pool slots give
the colocated reference's greedy tokens exactly; batching does not change a sequence's tokens;
two processes build the same weights, KV bytes and vocabulary; KV moved as raw bytes between
pools (different slots) decodes the same; the pool and weight tensors are never reallocated.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch engine needs the torch extra")
pytest.importorskip("tokenizers", reason="the torch engine's tokenizer needs the torch extra")

from pd_worker.torch_engine.config import DEFAULT_MODEL_CONFIG, ModelConfig, ModelConfigError
from pd_worker.torch_engine.kv_pool import KVPool, PoolExhausted, SlotError
from pd_worker.torch_engine.model import DecodeSeq, ModelInputError, TorchModel
from pd_worker.torch_engine.tokenizer import build_tokenizer, decode, encode

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 12
PROMPT_LENGTHS = (1, 4, 17, 33, 70)


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.load()


@pytest.fixture(scope="module")
def model(config: ModelConfig) -> TorchModel:
    return TorchModel(config, KVPool(config, 2048, "cpu"), "cpu")


@pytest.fixture(scope="module")
def prompts(config: ModelConfig) -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(config.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def decode_alone(model: TorchModel, slots: list[int], first: int, steps: int) -> list[int]:
    """Decode one sequence whose prompt KV is in ``slots``, one step at a time."""
    context, out = list(slots), [first]
    for _ in range(steps):
        new_slot = model.pool.alloc(1)[0]
        out += model.decode_step([DecodeSeq(list(context), out[-1], new_slot)])
        context.append(new_slot)
    model.pool.free(context)
    return out


def test_prefill_then_decode_steps_give_the_colocated_reference_tokens(model, prompts):
    for ids in prompts:
        slots = model.pool.alloc(len(ids))
        first = model.prefill(ids, slots)
        assert decode_alone(model, slots, first, NEW_TOKENS - 1) == model.generate(ids, NEW_TOKENS)


def test_outputs_depend_on_the_prompt(model, prompts):
    outputs = {tuple(model.generate(ids, NEW_TOKENS)) for ids in prompts}
    assert len(outputs) == len(prompts)


def test_one_batched_decode_step_over_sequences_of_different_lengths_matches_each_alone(
    model, prompts
):
    pool = model.pool
    contexts, outs = [], []
    for ids in prompts:
        slots = pool.alloc(len(ids))
        outs.append([model.prefill(ids, slots)])
        contexts.append(slots)
    for _ in range(NEW_TOKENS - 1):
        new_slots = pool.alloc(len(prompts))
        batch = [
            DecodeSeq(list(context), out[-1], new_slot)
            for context, out, new_slot in zip(contexts, outs, new_slots, strict=True)
        ]
        for out, token in zip(outs, model.decode_step(batch), strict=True):
            out.append(token)
        for context, new_slot in zip(contexts, new_slots, strict=True):
            context.append(new_slot)
    for context in contexts:
        pool.free(context)
    assert outs == [model.generate(ids, NEW_TOKENS) for ids in prompts]


def test_a_batched_decode_step_writes_the_same_kv_bytes_as_steps_alone(model, prompts):
    """Bitwise, not merely the same argmax: later steps attend to these bytes."""
    pool = model.pool
    contexts = [pool.alloc(len(ids)) for ids in prompts]
    firsts = [model.prefill(ids, slots) for ids, slots in zip(prompts, contexts, strict=True)]
    alone, batched = pool.alloc(len(prompts)), pool.alloc(len(prompts))
    for context, first, new_slot in zip(contexts, firsts, alone, strict=True):
        model.decode_step([DecodeSeq(context, first, new_slot)])
    model.decode_step(
        [
            DecodeSeq(context, first, new_slot)
            for context, first, new_slot in zip(contexts, firsts, batched, strict=True)
        ]
    )
    assert [slot_bytes(pool, slot) for slot in batched] == [
        slot_bytes(pool, slot) for slot in alone
    ]
    for slots in (*contexts, alone, batched):
        pool.free(slots)


def slot_bytes(pool: KVPool, slot: int) -> bytes:
    ((offset, length),) = pool.byte_ranges([slot])
    return ctypes.string_at(pool.data_ptr + offset, length)


def test_kv_copied_as_bytes_into_other_slots_of_another_pool_decodes_the_same(config, prompts):
    source = TorchModel(config, KVPool(config, 256, "cpu"), "cpu")
    target = TorchModel(config, KVPool(config, 256, "cpu"), "cpu")
    target.pool.alloc(5)  # the two pools fragment differently
    ids = prompts[3]
    src_slots = source.pool.alloc(len(ids))
    first = source.prefill(ids, src_slots)
    hole = target.pool.alloc(len(ids) // 2 + 3)
    target.pool.free(hole[::3])
    dst_slots = target.pool.alloc(len(ids))
    assert source.pool.byte_ranges(src_slots) != target.pool.byte_ranges(dst_slots)
    copy_ranges(source.pool, src_slots, target.pool, dst_slots)
    out = decode_alone(target, dst_slots, first, NEW_TOKENS - 1)
    assert out == source.generate(ids, NEW_TOKENS)


def copy_ranges(src: KVPool, src_slots: list[int], dst: KVPool, dst_slots: list[int]) -> None:
    """What a transfer engine does: memmove each byte run, cut where either side's run ends."""
    remote, local = src.byte_ranges(src_slots), dst.byte_ranges(dst_slots)
    r = lo = r_done = l_done = 0
    while r < len(remote) and lo < len(local):
        length = min(remote[r][1] - r_done, local[lo][1] - l_done)
        ctypes.memmove(
            dst.data_ptr + local[lo][0] + l_done, src.data_ptr + remote[r][0] + r_done, length
        )
        r_done, l_done = r_done + length, l_done + length
        if r_done == remote[r][1]:
            r, r_done = r + 1, 0
        if l_done == local[lo][1]:
            lo, l_done = lo + 1, 0


def fingerprint(config: ModelConfig, ids: list[int]) -> dict[str, object]:
    """What must agree between the prefill's and the decode's processes (run in both)."""
    model = TorchModel(config, KVPool(config, 64, "cpu"), "cpu")
    slots = model.pool.alloc(len(ids))
    first = model.prefill(ids, slots)
    (offset, length), *_ = model.pool.byte_ranges(slots)
    return {
        "first": first,
        "kv_sha256": hashlib.sha256(
            ctypes.string_at(model.pool.data_ptr + offset, length)
        ).hexdigest(),
        "generated": model.generate(ids, NEW_TOKENS),
        "vocab_sha256": hashlib.sha256(build_tokenizer(config).to_str().encode()).hexdigest(),
    }


CHILD = """
import json, sys
from pd_worker.torch_engine.config import ModelConfig
from tests.test_torch_engine import fingerprint
print(json.dumps(fingerprint(ModelConfig.load(), json.loads(sys.argv[1]))))
"""


def test_another_process_builds_the_same_weights_kv_bytes_and_vocabulary(config, prompts):
    ids = prompts[2]
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(ids)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(child.stdout) == fingerprint(config, ids)


def test_steps_never_reallocate_the_pool_or_the_weights(model, prompts):
    pool_ptr, weight_ptrs = model.pool.data_ptr, model.weight_ptrs()
    for ids in prompts:
        model.generate(ids, NEW_TOKENS)
    assert (model.pool.data_ptr, model.weight_ptrs()) == (pool_ptr, weight_ptrs)


def test_generate_frees_the_slots_it_used(model, prompts):
    free = model.pool.free_slots
    model.generate(prompts[-1], NEW_TOKENS)
    assert model.pool.free_slots == free


def test_prefill_refuses_token_ids_outside_the_vocabulary(model, config):
    slots = model.pool.alloc(2)
    with pytest.raises(ModelInputError):
        model.prefill([1, config.vocab_size], slots)
    model.pool.free(slots)


def test_decode_step_refuses_a_position_past_max_position(model, config):
    past_end = list(range(config.max_position))
    with pytest.raises(ModelInputError):
        model.decode_step([DecodeSeq(past_end, 1, config.max_position)])


def test_pool_allocates_distinct_slots_lowest_first_and_takes_them_back(config):
    pool = KVPool(config, 8, "cpu")
    first, second = pool.alloc(3), pool.alloc(2)
    assert (first, second, pool.free_slots) == ([0, 1, 2], [3, 4], 3)
    pool.free(first)
    assert pool.alloc(4) == [0, 1, 2, 5]


def test_pool_refuses_more_slots_than_are_free_and_allocates_none(config):
    pool = KVPool(config, 8, "cpu")
    pool.alloc(6)
    with pytest.raises(PoolExhausted) as refused:
        pool.alloc(3)
    assert (refused.value.requested, refused.value.free, pool.free_slots) == (3, 2, 2)


def test_pool_refuses_to_free_a_slot_twice(config):
    pool = KVPool(config, 8, "cpu")
    slots = pool.alloc(2)
    pool.free(slots)
    with pytest.raises(SlotError):
        pool.free(slots[:1])


def test_byte_ranges_are_one_run_per_consecutive_slots_in_the_order_given(config):
    pool = KVPool(config, 16, "cpu")
    size = pool.slot_bytes
    assert pool.byte_ranges([7, 8, 9, 2, 3, 12]) == [
        (7 * size, 3 * size),
        (2 * size, 2 * size),
        (12 * size, size),
    ]
    assert size * pool.num_slots == pool.nbytes == pool.kv.numel() * pool.kv.element_size()


def test_a_slot_holds_every_layers_k_and_v_of_one_token(config):
    pool = KVPool(config, 4, "cpu")
    assert pool.slot_bytes == config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4


def test_tokenizer_round_trips_text(config):
    tokenizer = build_tokenizer(config)
    for text in ("The prefill writes the prompt's KV.", "Grüße, 你好 🙂\n\ttabs  and  spaces", ""):
        assert decode(tokenizer, encode(tokenizer, text)) == text


def test_tokenizer_ids_fit_the_model_vocabulary(config):
    tokenizer = build_tokenizer(config)
    assert tokenizer.get_vocab_size() <= config.vocab_size
    assert max(encode(tokenizer, "any text at all: ~^`|\x7f")) < config.vocab_size


def test_model_config_refuses_unknown_keys(tmp_path):
    body = json.loads(DEFAULT_MODEL_CONFIG.read_text()) | {"num_experts": 8}
    path = tmp_path / "model.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ModelConfigError):
        ModelConfig.load(path)
