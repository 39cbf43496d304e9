"""OpenAI ``/v1/completions`` and ``/v1/chat/completions`` shapes, as SGLang serves them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pd_worker.errors import BadRequest
from pd_worker.protocol import Prompt, build_items, is_token_id
from pd_worker.requests import GenItem, Progress
from pd_worker.tokens import chat_prompt, tokenize

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_DEFAULT_MAX_TOKENS = 128


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed OpenAI request: its items (prompt-major, ``n`` per prompt) and how to answer."""

    kind: str
    request_id: str
    model: str
    items: list[GenItem]
    n: int
    stream: bool
    include_usage: bool
    created: int


def parse_completion(body: Any, model: str) -> OpenAIRequest:
    body = _require_object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids_list = [tokenize(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        ids_list = [tokenize(p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt):
        ids_list = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(_is_int_list(p) for p in prompt):
        ids_list = [list(p) for p in prompt]
    else:
        raise BadRequest("prompt must be a string, a list of strings or token ids")
    return _build("completion", body, ids_list, model, COMPLETION_DEFAULT_MAX_TOKENS)


def parse_chat(body: Any, model: str) -> OpenAIRequest:
    body = _require_object(body)
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        raise BadRequest("messages must be a non-empty list of message objects")
    return _build("chat", body, [tokenize(chat_prompt(messages))], model, CHAT_DEFAULT_MAX_TOKENS)


def _build(
    kind: str, body: dict[str, Any], ids_list: list[list[int]], model: str, default_max: int
) -> OpenAIRequest:
    n = body.get("n", 1)
    if not _is_int(n) or n < 1:
        raise BadRequest("n must be a positive integer")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max
    if not _is_int(max_tokens):
        raise BadRequest("max_tokens must be a non-negative integer")
    sampling = {
        "max_new_tokens": max_tokens,
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
    }
    prefix = "cmpl-" if kind == "completion" else "chatcmpl-"
    request_id = str(body.get("rid") or prefix + uuid.uuid4().hex)
    total = len(ids_list) * n
    rids = [request_id] if total == 1 else [f"{request_id}-{i}" for i in range(total)]
    prompts = [Prompt(ids, sampling) for ids in ids_list]
    items = build_items(dict(body, return_logprob=False), prompts, n, rids)
    options = body.get("stream_options") or {}
    return OpenAIRequest(
        kind=kind,
        request_id=request_id,
        model=str(body.get("model") or model),
        items=items,
        n=n,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        created=int(time.time()),
    )


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        choice.update({"logprobs": None, "finish_reason": finish_reason, "matched_stop": matched})
        choices.append(choice)
    return {
        "id": request.request_id,
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": choices,
        "usage": usage(request, results),
    }


def chunk(
    request: OpenAIRequest, index: int, delta: str, progress: Progress | None, *, first: bool
) -> dict[str, Any]:
    """One streaming chunk: a text delta (or the chat role announcement) for choice ``index``."""
    finish_reason, matched = _finish(progress) if progress is not None else (None, None)
    choice: dict[str, Any] = {"index": index}
    if request.kind == "chat":
        choice["delta"] = {"role": "assistant", "content": ""} if first else {"content": delta}
    else:
        choice["text"] = delta
    choice.update({"logprobs": None, "finish_reason": finish_reason, "matched_stop": matched})
    return {
        "id": request.request_id,
        "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
        "created": request.created,
        "model": request.model,
        "choices": [choice],
        "usage": None,
    }


def usage_chunk(request: OpenAIRequest, results: list[Progress]) -> dict[str, Any]:
    """The final chunk of a stream with ``stream_options.include_usage``."""
    return {
        "id": request.request_id,
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
