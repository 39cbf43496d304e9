"""Whether a worker's 2xx answer reports that the request was aborted.

How SGLang answers an aborted request (0.5.23: ``entrypoints/http_server.py``,
``managers/tokenizer_manager.py``, ``entrypoints/openai/serving_chat.py``), and the reference
worker (``pd_worker``) the same way:

- non-streaming: an abort with a status code (a scheduler abort such as a failed KV transfer,
  500; a request error, 400) becomes that HTTP status; one without a status code (an
  ``/abort_request`` or ``abort_all``) answers 200 with ``meta_info.finish_reason`` =
  ``{"type": "abort", "message"}`` (``choices[].finish_reason`` = ``"abort"`` on the OpenAI
  routes);
- streaming: the status is 200 from the start. An abort is an event whose
  ``meta_info.finish_reason`` is ``{"type": "abort", "message", "status_code"?}``; a request
  error (and on the OpenAI routes an abort with a status code) is an event
  ``{"error": {"message", "code"}}``; ``data: [DONE]`` follows either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from pd_protocol.json_values import is_int

# Every abort shape above has one of these tokens; an answer with neither is not parsed.
_TOKENS = (b'"abort"', b'"error"')


@dataclass(frozen=True, slots=True)
class Abort:
    """An aborted request: the worker's message and the status code it gave, if any."""

    message: str
    status: int | None


def find_abort(body: bytes, content_type: str) -> Abort | None:
    """The first abort or error that ``body`` (JSON or SSE) reports, or None."""
    if _TOKENS[0] not in body and _TOKENS[1] not in body:
        return None
    for payload in _payloads(body, content_type):
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        for item in value if isinstance(value, list) else (value,):
            abort = _item_abort(item)
            if abort is not None:
                return abort
    return None


def _payloads(body: bytes, content_type: str) -> Iterator[bytes]:
    if content_type != "text/event-stream":
        yield body
        return
    for line in body.splitlines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data != b"[DONE]":
                yield data


def _item_abort(item: Any) -> Abort | None:
    if not isinstance(item, dict):
        return None
    error = item.get("error")
    if isinstance(error, dict):
        return Abort(str(error.get("message", "")), _status(error.get("code")))
    meta = item.get("meta_info")
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return Abort(str(reason.get("message", "")), _status(reason.get("status_code")))
    choices = item.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
                return Abort("generation aborted", None)
    return None


def _status(value: Any) -> int | None:
    """An HTTP error status, or None (absent, or not a status)."""
    if is_int(value) and 400 <= value < 600:
        return value
    return None
