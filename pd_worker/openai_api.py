"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` shapes, as SGLang serves them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pd_protocol.json_values import is_int
from pd_worker import logprobs
from pd_worker.errors import BadRequest
from pd_worker.protocol import Prompt, Tokenize, build_items, is_token_id, item_rids
from pd_worker.requests import GenItem, Progress
from pd_worker.tokens import chat_prompt, tokenize

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed OpenAI request: its items (prompt-major, ``n`` per prompt) and how to answer.

    As in SGLang, a response or chunk carries the rid of the item it reports as its ``id``
    (the first item's for a whole response)."""

    kind: str
    model: str
    items: list[GenItem]
    n: int
    stream: bool
    include_usage: bool
    created: int


def parse_completion(
    body: dict[str, Any], model: str, tokenizer: Tokenize = tokenize
) -> OpenAIRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids_list, batch = [tokenizer(prompt)], False
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        ids_list, batch = [tokenizer(p) for p in prompt], True
    elif isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt):
        ids_list, batch = [list(prompt)], False
    elif isinstance(prompt, list) and prompt and all(_is_int_list(p) for p in prompt):
        ids_list, batch = [list(p) for p in prompt], True
    else:
        raise BadRequest("prompt must be a string, a list of strings or token ids")
    logprobs_num = body.get("logprobs")
    if logprobs_num is not None and not _is_count(logprobs_num):
        raise BadRequest("logprobs must be a non-negative integer")
    logprob = {"return_logprob": logprobs_num is not None, "top_logprobs_num": logprobs_num or 0}
    return _build(
        "completion", body, ids_list, batch, model, COMPLETION_DEFAULT_MAX_TOKENS, logprob
    )


def parse_chat(body: dict[str, Any], model: str, tokenizer: Tokenize = tokenize) -> OpenAIRequest:
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        raise BadRequest("messages must be a non-empty list of message objects")
    ids_list = [tokenizer(chat_prompt(messages))]
    top = body.get("top_logprobs")
    if top is not None and not _is_count(top):
        raise BadRequest("top_logprobs must be a non-negative integer")
    logprob = {"return_logprob": body.get("logprobs") is True, "top_logprobs_num": top or 0}
    return _build("chat", body, ids_list, False, model, CHAT_DEFAULT_MAX_TOKENS, logprob)


def _build(
    kind: str,
    body: dict[str, Any],
    ids_list: list[list[int]],
    batch: bool,
    model: str,
    default_max: int,
    logprob: dict[str, Any],
) -> OpenAIRequest:
    """The items SGLang's OpenAI layer would hand to ``GenerateReqInput`` (``rid`` passes
    through unchanged, so it is normalized as on ``/generate``; logprobs always come with their
    token text)."""
    n = body.get("n", 1)
    if not _is_count(n) or n < 1:
        raise BadRequest("n must be a positive integer")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max
    if not _is_count(max_tokens):
        raise BadRequest("max_tokens must be a non-negative integer")
    sampling = {
        "max_new_tokens": max_tokens,
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
    }
    rids = item_rids(body.get("rid"), len(ids_list), n, batch or n > 1)
    prompts = [Prompt(ids, sampling) for ids in ids_list]
    generate = {**body, **logprob, "return_text_in_logprobs": True}
    items = build_items(generate, prompts, n, rids)
    options = body.get("stream_options") or {}
    return OpenAIRequest(
        kind=kind,
        model=str(body.get("model") or model),
        items=items,
        n=n,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        created=int(time.time()),
    )


def _is_count(value: Any) -> bool:
    """A non-negative integer (not a bool)."""
    return is_int(value) and value >= 0


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_token_id(t) for t in value)


def _finish(progress: Progress) -> tuple[str | None, Any]:
    reason = progress.finish_reason
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


def usage(request: OpenAIRequest, results: list[Progress]) -> dict[str, Any]:
    """SGLang's UsageProcessor: prompt tokens once per prompt, completion tokens per choice."""
    prompt_tokens = sum(
        len(request.items[i].prompt_ids) for i in range(0, len(request.items), request.n)
    )
    completion_tokens = sum(len(p.output_ids) for p in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def response(request: OpenAIRequest, results: list[Progress]) -> dict[str, Any]:
    """The non-streaming response object."""
    choices = []
    for index, progress in enumerate(results):
        finish_reason, matched = _finish(progress)
        choice: dict[str, Any] = {"index": index}
        if request.kind == "chat":
            choice["message"] = {
                "role": "assistant",
                "content": progress.text,
                "reasoning_content": None,
                "tool_calls": None,
            }
        else:
            choice["text"] = progress.text
        choice.update(
            {
                "logprobs": _logprobs(request, request.items[index], progress, 0),
                "finish_reason": finish_reason,
                "matched_stop": matched,
            }
        )
        choices.append(choice)
    return {
        "id": request.items[0].rid,
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": choices,
        "usage": usage(request, results),
    }


def _logprobs(
    request: OpenAIRequest, item: GenItem, progress: Progress | None, start: int
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` for the output tokens from ``start`` on (None unless asked)."""
    if progress is None or not item.return_logprob:
        return None
    if request.kind == "chat":
        return logprobs.chat_logprobs(item, progress, start)
    return logprobs.completion_logprobs(item, progress, start)


def chunk(
    request: OpenAIRequest,
    index: int,
    delta: str,
    progress: Progress | None,
    *,
    first: bool,
    sent_tokens: int,
) -> dict[str, Any]:
    """One streaming chunk: a text delta (or the chat role announcement) for choice ``index``,
    with the logprobs of the tokens after the first ``sent_tokens``."""
    finish_reason, matched = _finish(progress) if progress is not None else (None, None)
    choice_logprobs = (
        None if first else _logprobs(request, request.items[index], progress, sent_tokens)
    )
    choice: dict[str, Any] = {"index": index}
    if request.kind == "chat":
        choice["delta"] = {"role": "assistant", "content": ""} if first else {"content": delta}
    else:
        choice["text"] = delta
    choice.update(
        {"logprobs": choice_logprobs, "finish_reason": finish_reason, "matched_stop": matched}
    )
    return {
        "id": request.items[index].rid,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [choice],
        "usage": None,
    }


def usage_chunk(request: OpenAIRequest, results: list[Progress], last: int) -> dict[str, Any]:
    """The final chunk of a stream with ``stream_options.include_usage``; its ``id`` is that of
    the item whose output came last, as in SGLang."""
    return {
        "id": request.items[last].rid,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [],
        "usage": usage(request, results),
    }


def stream_error(message: str, status: int, type_name: str) -> dict[str, Any]:
    """SGLang's streaming error chunk (``create_streaming_error_response``)."""
    return {
        "error": {
            "object": "error",
            "message": message,
            "type": type_name,
            "param": None,
            "code": status,
        }
    }
