"""Merging the prefill's input logprobs into the decode's answer (``return_logprob`` on
/generate).

In PD mode the prefill computes ``meta_info.input_token_logprobs`` and the decode only knows its
own; the client expects the whole list, as a non-disaggregated server would return it. Items of a
batch are matched by their ``index`` (streaming) or their position (non-streaming).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

PrefillLogprobs = dict[int, list]


def _record(obj: Any, out: PrefillLogprobs, default_index: int) -> None:
    if not isinstance(obj, dict):
        return
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        return
    logprobs = meta.get("input_token_logprobs")
    index = obj.get("index", default_index)
    if isinstance(logprobs, list) and isinstance(index, int):
        out.setdefault(index, logprobs)


def _sse_payloads(body: bytes) -> list[Any]:
    payloads = []
    for event in body.split(b"\n\n"):
        event = event.strip()
        if not event.startswith(b"data:"):
            continue
        data = event[5:].strip()
        if data == b"[DONE]":
            continue
        try:
            payloads.append(orjson.loads(data))
        except orjson.JSONDecodeError:
            continue
    return payloads


def prefill_logprobs(body: bytes) -> PrefillLogprobs:
    """The prefill's input logprobs per item index, from a JSON or an SSE body."""
    out: PrefillLogprobs = {}
    if body.lstrip().startswith(b"data:"):
        for payload in _sse_payloads(body):
            _record(payload, out, 0)
        return out
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return out
    items = parsed if isinstance(parsed, list) else [parsed]
    for i, item in enumerate(items):
        _record(item, out, i)
    return out


def _merge_into(obj: Any, prefill: PrefillLogprobs, default_index: int) -> None:
    if not isinstance(obj, dict):
        return
    meta = obj.get("meta_info")
    logprobs = prefill.get(obj.get("index", default_index))
    if not isinstance(meta, dict) or logprobs is None:
        return
    own = meta.get("input_token_logprobs")
    meta["input_token_logprobs"] = logprobs + (own if isinstance(own, list) else [])


def merge_body(decode_body: bytes, prefill: PrefillLogprobs) -> bytes:
    """A non-streaming decode body with the prefill's logprobs prepended (unchanged if either
    side is not the expected JSON)."""
    if not prefill:
        return decode_body
    try:
        parsed = orjson.loads(decode_body)
    except orjson.JSONDecodeError:
        return decode_body
    items = parsed if isinstance(parsed, list) else [parsed]
    for i, item in enumerate(items):
        _merge_into(item, prefill, i)
    return orjson.dumps(parsed)


def merge_event(event: bytes, prefill: PrefillLogprobs) -> bytes:
    """One SSE event (``data: {...}\\n\\n``) with the prefill's logprobs prepended."""
    if not event.startswith(b"data:"):
        return event
    data = event[5:].strip()
    if data == b"[DONE]":
        return event
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return event
    _merge_into(parsed, prefill, 0)
    return b"data: " + orjson.dumps(parsed) + b"\n\n"


async def merged_events(
    chunks: AsyncIterator[bytes], prefill: PrefillLogprobs
) -> AsyncIterator[bytes]:
    """Re-cut a decode SSE stream into whole events and merge each one."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[: end + 2], buffer[end + 2 :]
            yield merge_event(event, prefill)
    if buffer:
        yield buffer
