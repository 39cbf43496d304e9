"""A small Llama in plain torch: prefill into pool slots, batched greedy decode from them.

RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP, with random weights drawn
from ``config.seed`` on the CPU generator, so every process that loads the same config holds the
same weights (the prefill and the decode of a pair must). All tensors are created in the
constructor; steps only write token KV into the pool's existing tensor, so a role switch that
keeps the model keeps every ``data_ptr``.

Greedy outputs are bitwise independent of batching: the decode step's projections run as one
batched matmul of per-row products (``torch.bmm``: a row's result does not depend on the rows
beside it, whereas one ``[B, in] @ [in, out]`` gemm rounds a single row differently from a batch
of them), and attention runs per sequence over exactly its own slots (a padded, masked batch
would sum a different number of terms). A request therefore yields the same tokens whether it is
decoded alone (:meth:`TorchModel.generate`, the colocated reference) or batched with others
after a KV transfer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pd_worker.torch_engine.config import ModelConfig
from pd_worker.torch_engine.kv_pool import KVPool

K, V = 0, 1
Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModelInputError(ValueError):
    """Token ids, slots or positions the model cannot run on."""


@dataclass(frozen=True)
class DecodeSeq:
    """One sequence of a decode step: ``slots`` hold the KV of its tokens so far (prompt and
    generated), ``last_token`` is the token to feed (its KV goes to ``new_slot``)."""

    slots: list[int]
    last_token: int
    new_slot: int


def default_device() -> str:
    """CUDA when available, the CPU otherwise."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _init_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Random weights in a fixed order from ``config.seed`` (CPU generator: the same values on
    every machine and process); projections scaled by 1/sqrt(fan_in) so activations stay O(1)."""
    gen = torch.Generator(device="cpu").manual_seed(config.seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * std

    def proj(out_dim: int, in_dim: int) -> torch.Tensor:
        return normal(out_dim, in_dim, 1 / math.sqrt(in_dim))

    weights = {"embed": normal(config.vocab_size, hidden, 1.0)}
    for layer in range(config.num_layers):
        weights |= {
            f"layers.{layer}.attn_norm": torch.ones(hidden),
            f"layers.{layer}.wq": proj(q_dim, hidden),
            f"layers.{layer}.wk": proj(kv_dim, hidden),
            f"layers.{layer}.wv": proj(kv_dim, hidden),
            f"layers.{layer}.wo": proj(hidden, q_dim),
            f"layers.{layer}.mlp_norm": torch.ones(hidden),
            f"layers.{layer}.w_gate": proj(inter, hidden),
            f"layers.{layer}.w_up": proj(inter, hidden),
            f"layers.{layer}.w_down": proj(hidden, inter),
        }
    weights["final_norm"] = torch.ones(hidden)
    if not config.tie_word_embeddings:
        weights["lm_head"] = proj(config.vocab_size, hidden)
    return weights


def _rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, ``[max_position, head_dim // 2]``."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(config.max_position, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [tokens, heads, head_dim]`` (halves layout, as Llama's HF port);
    ``cos``/``sin`` are ``[tokens, head_dim // 2]``."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _rowwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [B, in] @ weight.T`` as B independent row products (see the module docstring)."""
    rows = x.shape[0]
    return torch.bmm(x.unsqueeze(1), weight.t().expand(rows, -1, -1)).squeeze(1)


class TorchModel:
    """The model over a :class:`KVPool`. Steps are synchronous and CPU/GPU-bound: run them off the
    event loop, one at a time."""

    def __init__(self, config: ModelConfig, pool: KVPool, device: str | torch.device) -> None:
        # Process-wide: the same thread count in every role keeps kernels, and so outputs,
        # identical across processes.
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.pool = pool
        self.device = torch.device(device)
        dtype = getattr(torch, config.dtype)
        self.weights = {
            name: tensor.to(device=self.device, dtype=dtype)
            for name, tensor in _init_weights(config).items()
        }
        self._layers = [
            {
                name.removeprefix(f"layers.{layer}."): tensor
                for name, tensor in self.weights.items()
                if name.startswith(f"layers.{layer}.")
            }
            for layer in range(config.num_layers)
        ]
        cos, sin = _rope_tables(config)
        self._cos = cos.to(device=self.device, dtype=dtype)
        self._sin = sin.to(device=self.device, dtype=dtype)
        self._groups = config.num_heads // config.num_kv_heads
        self._scale = 1 / math.sqrt(config.head_dim)

    def weight_ptrs(self) -> dict[str, int]:
        return {name: tensor.data_ptr() for name, tensor in self.weights.items()}

    @property
    def _lm_head(self) -> torch.Tensor:
        return self.weights["embed" if self.config.tie_word_embeddings else "lm_head"]

    @torch.inference_mode()
    def prefill(self, ids: list[int], slots: list[int]) -> int:
        """Write the KV of ``ids`` into ``slots`` (one each, in order); the greedy next token."""
        if not ids or len(ids) != len(slots):
            raise ModelInputError(f"{len(ids)} prompt tokens for {len(slots)} slots")
        self._check_tokens(ids)
        self._check_positions(len(ids))
        cfg = self.config
        tokens = len(ids)
        slot_index = self._slot_tensor(slots)
        cos, sin = self._cos[:tokens], self._sin[:tokens]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=self.device).tril()
        x = self.weights["embed"][torch.tensor(ids, device=self.device)]
        for layer in range(cfg.num_layers):
            w = self._layers[layer]
            h = self._norm(x, w["attn_norm"])
            q = _rotate(F.linear(h, w["wq"]).view(tokens, cfg.num_heads, -1), cos, sin)
            k = _rotate(F.linear(h, w["wk"]).view(tokens, cfg.num_kv_heads, -1), cos, sin)
            v = F.linear(h, w["wv"]).view(tokens, cfg.num_kv_heads, -1)
            self.pool.kv[slot_index, layer, K] = k
            self.pool.kv[slot_index, layer, V] = v
            # [kv_heads, groups, tokens, head_dim] against [kv_heads, 1, tokens, head_dim]
            q = q.view(tokens, cfg.num_kv_heads, self._groups, -1).permute(1, 2, 0, 3)
            k, v = k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1)
            scores = (q @ k.transpose(-1, -2)) * self._scale
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            attn = (probs @ v).permute(2, 0, 1, 3).reshape(tokens, -1)
            x = x + F.linear(attn, w["wo"])
            x = x + self._mlp(self._norm(x, w["mlp_norm"]), w, F.linear)
        return self._greedy(x[-1:])[0]

    @torch.inference_mode()
    def decode_step(self, batch: list[DecodeSeq]) -> list[int]:
        """One greedy token for each sequence, batched; writes each ``last_token``'s KV into its
        ``new_slot``."""
        if not batch:
            return []
        self._check_batch(batch)
        cfg = self.config
        positions = torch.tensor([len(seq.slots) for seq in batch], device=self.device)
        new_slots = self._slot_tensor([seq.new_slot for seq in batch])
        contexts = [self._slot_tensor([*seq.slots, seq.new_slot]) for seq in batch]
        cos, sin = self._cos[positions], self._sin[positions]
        rows = len(batch)
        x = self.weights["embed"][
            torch.tensor([seq.last_token for seq in batch], device=self.device)
        ]
        for layer in range(cfg.num_layers):
            w = self._layers[layer]
            h = self._norm(x, w["attn_norm"])
            q = _rotate(_rowwise(h, w["wq"]).view(rows, cfg.num_heads, -1), cos, sin)
            k = _rotate(_rowwise(h, w["wk"]).view(rows, cfg.num_kv_heads, -1), cos, sin)
            v = _rowwise(h, w["wv"]).view(rows, cfg.num_kv_heads, -1)
            self.pool.kv[new_slots, layer, K] = k
            self.pool.kv[new_slots, layer, V] = v
            attn = torch.stack([self._attend(q[row], contexts[row], layer) for row in range(rows)])
            x = x + _rowwise(attn, w["wo"])
            x = x + self._mlp(self._norm(x, w["mlp_norm"]), w, _rowwise)
        return self._greedy(x)

    def generate(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """The colocated reference: prefill and decode one request alone, on slots of its own
        (freed after). The first of the ``max_new_tokens`` tokens comes from the prefill."""
        if max_new_tokens <= 0:
            return []
        self._check_positions(len(ids) + max_new_tokens - 1)
        slots = self.pool.alloc(len(ids) + max_new_tokens - 1)
        try:
            prompt_slots, new_slots = slots[: len(ids)], slots[len(ids) :]
            out = [self.prefill(ids, prompt_slots)]
            context = list(prompt_slots)
            for new_slot in new_slots:
                out += self.decode_step([DecodeSeq(list(context), out[-1], new_slot)])
                context.append(new_slot)
            return out
        finally:
            self.pool.free(slots)

    def _attend(self, q: torch.Tensor, context: torch.Tensor, layer: int) -> torch.Tensor:
        """One query token ``[heads, head_dim]`` over the KV in its ``context`` slots."""
        kv = self.pool.kv[context, layer]  # [tokens, 2, kv_heads, head_dim]
        k, v = kv[:, K].transpose(0, 1), kv[:, V].transpose(0, 1)  # [kv_heads, tokens, head_dim]
        q = q.view(self.config.num_kv_heads, self._groups, -1)
        probs = ((q @ k.transpose(-1, -2)) * self._scale).softmax(-1)
        return (probs @ v).reshape(-1)

    def _mlp(self, h: torch.Tensor, w: dict[str, torch.Tensor], linear: Linear) -> torch.Tensor:
        return linear(F.silu(linear(h, w["w_gate"])) * linear(h, w["w_up"]), w["w_down"])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * weight

    def _greedy(self, x: torch.Tensor) -> list[int]:
        logits = _rowwise(self._norm(x, self.weights["final_norm"]), self._lm_head)
        return logits.argmax(-1).tolist()

    def _slot_tensor(self, slots: list[int]) -> torch.Tensor:
        if any(not 0 <= slot < self.pool.num_slots for slot in slots):
            raise ModelInputError(f"slots outside the pool of {self.pool.num_slots}")
        return torch.tensor(slots, device=self.device)

    def _check_tokens(self, ids: list[int]) -> None:
        if any(not 0 <= token < self.config.vocab_size for token in ids):
            raise ModelInputError(f"token ids must lie in [0, {self.config.vocab_size})")

    def _check_positions(self, last_position: int) -> None:
        if last_position > self.config.max_position:
            raise ModelInputError(
                f"{last_position} tokens exceed max_position {self.config.max_position}"
            )

    def _check_batch(self, batch: list[DecodeSeq]) -> None:
        self._check_tokens([seq.last_token for seq in batch])
        self._check_positions(max(len(seq.slots) for seq in batch) + 1)
        if len({seq.new_slot for seq in batch}) != len(batch):
            raise ModelInputError("two sequences of a decode step share a new slot")
