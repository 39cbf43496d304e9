"""Logprob fields as SGLang 0.5.23 reports them: ``meta_info`` on ``/generate``
(``TokenizerManager.add_logprob_to_meta_info``) and ``logprobs`` on the OpenAI routes.

Every entry is SGLang's ``(logprob, token_id, token_text)`` triple; ``token_text`` is None unless
``return_text_in_logprobs`` (the OpenAI routes always ask for it). The toy model has no
distribution, so a position's top candidates are its own token (most likely, with the token's
stand-in logprob) followed by fixed other ids with lower logprobs; a position without a logprob
(the first prompt token) has no top candidates (None).
"""

from __future__ import annotations

from typing import Any

from pd_worker.requests import GenItem, Progress
from pd_worker.tokens import VOCAB_SIZE, detokenize

# Stride between a position's top candidates (a prime, so candidates never repeat in the vocab).
CANDIDATE_STRIDE = 7919
CANDIDATE_LOGPROB_STEP = 1.0
BYTE_TOKENS = 256

Triple = list[Any]


def input_token_text(token_id: int) -> str:
    """The text of a prompt token: the toy tokenizer's tokens are UTF-8 bytes."""
    if token_id < BYTE_TOKENS:
        return bytes([token_id]).decode("utf-8", errors="replace")
    return detokenize([token_id])


def output_token_text(token_id: int) -> str:
    return detokenize([token_id])


def _with_text(entries: list[Triple], text: bool, decode: Any) -> list[Triple]:
    return [[lp, tid, decode(tid) if text else None] for lp, tid, _ in entries]


def _top(entry: Triple, k: int, text: bool, decode: Any) -> list[Triple] | None:
    logprob, token_id, _ = entry
    if logprob is None or k <= 0:
        return None
    rows = []
    for rank in range(k):
        candidate = (token_id + rank * CANDIDATE_STRIDE) % VOCAB_SIZE
        value = logprob - rank * CANDIDATE_LOGPROB_STEP
        rows.append([value, candidate, decode(candidate) if text else None])
    return rows


def meta_fields(item: GenItem, progress: Progress) -> dict[str, Any]:
    """The logprob keys of an item's ``meta_info`` (only when ``return_logprob``)."""
    text = item.return_text_in_logprobs
    inputs = progress.input_token_logprobs or []
    outputs = progress.output_token_logprobs or []
    fields: dict[str, Any] = {
        "input_token_logprobs": _with_text(inputs, text, input_token_text),
        "output_token_logprobs": _with_text(outputs, text, output_token_text),
        "output_token_logprobs_length": len(outputs),
    }
    k = item.top_logprobs_num
    if k > 0:
        fields["input_top_logprobs"] = [_top(e, k, text, input_token_text) for e in inputs]
        fields["output_top_logprobs"] = [_top(e, k, text, output_token_text) for e in outputs]
    return fields


def _output_rows(item: GenItem, progress: Progress, start: int) -> list[tuple[Triple, Any]]:
    """Output triples from position ``start`` with their top rows (text always included)."""
    outputs = (progress.output_token_logprobs or [])[start:]
    triples = _with_text(outputs, True, output_token_text)
    return [(t, _top(t, item.top_logprobs_num, True, output_token_text)) for t in triples]


def completion_logprobs(item: GenItem, progress: Progress, start: int = 0) -> dict[str, Any]:
    """OpenAI ``LogProbs`` of a completion choice (``to_openai_style_logprobs``), for the output
    tokens from ``start`` on; SGLang does not compute text offsets and reports -1."""
    rows = _output_rows(item, progress, start)
    return {
        "text_offset": [-1] * len(rows),
        "token_logprobs": [triple[0] for triple, _ in rows],
        "tokens": [triple[2] for triple, _ in rows],
        "top_logprobs": (
            [{t[2]: t[0] for t in top} if top is not None else None for _, top in rows]
            if item.top_logprobs_num > 0
            else []
        ),
    }


def _chat_token(triple: Triple) -> dict[str, Any]:
    return {"token": triple[2], "bytes": list(triple[2].encode("utf-8")), "logprob": triple[0]}


def chat_logprobs(item: GenItem, progress: Progress, start: int = 0) -> dict[str, Any]:
    """OpenAI ``ChoiceLogprobs`` of a chat choice, for the output tokens from ``start`` on."""
    content = []
    for triple, top in _output_rows(item, progress, start):
        token = _chat_token(triple)
        token["top_logprobs"] = [_chat_token(t) for t in top or ()]
        content.append(token)
    return {"content": content}
