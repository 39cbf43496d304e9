"""The torch engine's tokenizer: a byte-level BPE trained at start-up on a text in the package.

No download: the merges come from training on ``corpus.txt`` with the config's vocab size, which
takes milliseconds and gives the same vocabulary in every process (tests/test_torch_engine.py
checks it across processes). Byte-level, so any text round-trips, whatever the corpus.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pd_worker.torch_engine.config import ModelConfig

CORPUS = Path(__file__).with_name("corpus.txt")
BYTE_ALPHABET = 256


class TokenizerError(ValueError):
    """A vocabulary the model cannot produce or embed."""


def build_tokenizer(config: ModelConfig) -> Tokenizer:
    """A byte-level BPE of at most ``config.vocab_size`` tokens (every id it yields embeds)."""
    if config.vocab_size < BYTE_ALPHABET:
        raise TokenizerError(f"vocab_size {config.vocab_size} cannot hold the 256 byte tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS.read_text(encoding="utf-8")], trainer=trainer)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise TokenizerError(
            f"trained {tokenizer.get_vocab_size()} tokens for vocab_size {config.vocab_size}"
        )
    return tokenizer


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """The prompt's token ids (no special tokens: the model has none)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """The text of ``ids``; bytes that are not valid UTF-8 on their own decode to U+FFFD."""
    return tokenizer.decode(ids, skip_special_tokens=False)
