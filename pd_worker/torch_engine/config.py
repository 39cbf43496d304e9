"""The torch engine's model shape, read from a JSON file (``configs/torch-model.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DEFAULT_MODEL_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "torch-model.json"
DTYPES = ("float32", "float16", "bfloat16")


class ModelConfigError(ValueError):
    """A model config file that is missing, malformed or describes an impossible model."""


@dataclass(frozen=True)
class ModelConfig:
    """A Llama shape: every role builds the same weights from it (``seed``), so it must match
    across the prefill and decode processes, as the model files of an SGLang deployment do."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    seed: int
    dtype: str
    # torch's intra-op threads, set process-wide by the model: the same count everywhere keeps
    # kernels (and so outputs) identical across processes; 1 keeps several workers from
    # oversubscribing a small machine.
    num_threads: int

    @classmethod
    def load(cls, path: str | Path = DEFAULT_MODEL_CONFIG) -> ModelConfig:
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"cannot read model config {path}: {exc}") from None
        if not isinstance(body, dict):
            raise ModelConfigError(f"model config {path} is not a JSON object")
        return cls.from_dict(body)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        if missing := names - body.keys():
            raise ModelConfigError(f"model config lacks {sorted(missing)}")
        if unknown := body.keys() - names:
            raise ModelConfigError(f"model config has unknown keys {sorted(unknown)}")
        config = cls(**body)
        config.check()
        return config

    def check(self) -> None:
        """Shapes the model cannot be built with."""
        sizes = (
            self.vocab_size, self.hidden_size, self.num_layers, self.num_heads,
            self.num_kv_heads, self.head_dim, self.intermediate_size, self.max_position,
            self.num_threads,
        )  # fmt: skip
        if any(not isinstance(n, int) or n <= 0 for n in sizes):
            raise ModelConfigError("model sizes must be positive integers")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim must be even (rotary embeddings rotate pairs)")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype must be one of {DTYPES}")
