"""Writes the tiny Llama the real-SGLang tests serve: a Hugging Face checkpoint directory with
seeded real weights and a byte-level BPE tokenizer trained here, so nothing is downloaded.

Test support only (runs in the SGLang venv, which has torch, safetensors and tokenizers). The
weights are drawn from a fixed seed and scaled by 1/sqrt(fan_in), as pd_worker's torch engine
does: large enough that every output token depends on the whole prompt (SGLang's
``--load-format dummy`` weights are so small that the output follows the last token only, so a
broken KV hand-off would still produce the colocated server's tokens). The tokenizer is trained
on pd_worker's corpus and padded to the model's vocabulary with unused tokens.

    python tests/sglang_cpu/make_model.py DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = Path(__file__).resolve().parents[2] / "pd_worker" / "torch_engine" / "corpus.txt"
SEED = 20231116
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def weights() -> dict[str, torch.Tensor]:
    """Every tensor of a LlamaForCausalLM of CONFIG, in a fixed order from SEED."""
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    hidden, inter, vocab = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q_dim = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv_dim = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def proj(out_dim: int, in_dim: int) -> torch.Tensor:
        return torch.randn(out_dim, in_dim, generator=gen) / math.sqrt(in_dim)

    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}
    for i in range(CONFIG["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.input_layernorm.weight": torch.ones(hidden),
            f"{layer}.self_attn.q_proj.weight": proj(q_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": proj(kv_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": proj(kv_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": proj(hidden, q_dim),
            f"{layer}.post_attention_layernorm.weight": torch.ones(hidden),
            f"{layer}.mlp.gate_proj.weight": proj(inter, hidden),
            f"{layer}.mlp.up_proj.weight": proj(inter, hidden),
            f"{layer}.mlp.down_proj.weight": proj(hidden, inter),
        }
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = proj(vocab, hidden)
    return {name: t.contiguous() for name, t in tensors.items()}


def tokenizer() -> Tokenizer:
    """A byte-level BPE whose first ids are SPECIALS, padded with unused tokens to the vocab."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"] - 64,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    padding = CONFIG["vocab_size"] - tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(f"<unused{i}>", special=True) for i in range(padding)])
    assert tok.get_vocab_size() == CONFIG["vocab_size"], tok.get_vocab_size()
    return tok


def write(directory: Path) -> None:
    """The checkpoint, written to a temporary name and renamed: a reader never sees half."""
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(weights(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (tmp / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    tokenizer().save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "model_max_length": CONFIG["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    tmp.rename(directory)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if not (target / "config.json").exists():
        write(target)
    print(target)
