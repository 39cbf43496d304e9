"""Deterministic toy tokenizer and the decode's output function.

The reference worker has no model. Prompts are tokenized byte-wise (one token per UTF-8 byte), so
prompt lengths are predictable for the timing model. The decode's output is a pure function of the
prompt token ids *it received over the bootstrap connection* (not of its own copy of the prompt),
so a test can recompute it with :func:`expected_output_ids` / :func:`expected_text` and tell
whether the router paired the decode with the prefill that really holds the request's KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

VOCAB_SIZE = 32000
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "kv", "prefill", "decode",
    "token", "cache", "route", "pair", "room", "batch", "stream", "model", "server", "role",
    "switch", "drain", "ready",
)  # fmt: skip


def tokenize(text: str) -> list[int]:
    """One token per UTF-8 byte: simple, lossless and deterministic."""
    return list(text.encode("utf-8"))


def pack_prompt(prompt_ids: Sequence[int]) -> bytes:
    """The KV payload: the prompt ids as little-endian uint32 (what the decode digests)."""
    return struct.pack(f"<{len(prompt_ids)}I", *prompt_ids)


def output_ids_from_payload(payload: bytes, n_tokens: int) -> list[int]:
    """The decode's generated token ids: a SHA-256 counter stream seeded by the KV payload."""
    seed = hashlib.sha256(payload).digest()
    ids: list[int] = []
    counter = 0
    while len(ids) < n_tokens:
        block = hashlib.sha256(seed + counter.to_bytes(8, "little")).digest()
        ids.extend(int.from_bytes(block[i : i + 4], "little") % VOCAB_SIZE for i in range(0, 32, 4))
        counter += 1
    return ids[:n_tokens]


def detokenize(output_ids: Sequence[int]) -> str:
    """Text of generated ids: each id is one word with a leading space (prefix-stable)."""
    return "".join(" " + WORDS[token_id % len(WORDS)] for token_id in output_ids)


def expected_output_ids(prompt_ids: Sequence[int], n_tokens: int) -> list[int]:
    """Token ids a decode returns for a request whose KV came from a prefill of ``prompt_ids``."""
    return output_ids_from_payload(pack_prompt(prompt_ids), n_tokens)


def expected_text(prompt: str | Sequence[int], n_tokens: int) -> str:
    """Text a decode returns for ``prompt`` (text or token ids) and ``n_tokens`` generated tokens.

    A stop string or stop token in the request truncates it (``finish_reason`` ``stop``).
    """
    prompt_ids = tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    return detokenize(expected_output_ids(prompt_ids, n_tokens))


def chat_prompt(messages: Sequence[dict[str, object]]) -> str:
    """The toy chat template: what ``/v1/chat/completions`` tokenizes for a message list."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                str(part.get("text", "")) for part in content if isinstance(part, dict)
            )
        parts.append(f"<|{message.get('role')}|>\n{content or ''}\n")
    return "".join(parts) + "<|assistant|>\n"
