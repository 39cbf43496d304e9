"""Merging the prefill's input logprobs into the decode's answer (``return_logprob`` on
/generate).

In PD mode the prefill computes ``meta_info.input_token_logprobs`` (and, with
``top_logprobs_num``, ``input_top_logprobs``) and the decode only knows its own; the client
expects the whole lists, as a non-disaggregated server would return them. Items of a batch are
matched by their ``index`` (streaming) or their position (non-streaming).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

# Per item index, each input field the prefill answered with.
PrefillLogprobs = dict[int, dict[str, list]]
INPUT_FIELDS = ("input_token_logprobs", "input_top_logprobs")


def _record(obj: Any, out: PrefillLogprobs, default_index: int) -> None:
    if not isinstance(obj, dict):
        return
    meta = obj.get("meta_info")
    index = obj.get("index", default_index)
    if not isinstance(meta, dict) or not isinstance(index, int) or index in out:
        return
    fields = {f: meta[f] for f in INPUT_FIELDS if isinstance(meta.get(f), list)}
    if fields:
        out[index] = fields


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
    fields = prefill.get(obj.get("index", default_index))
    if not isinstance(meta, dict) or fields is None:
        return
    for name, logprobs in fields.items():
        own = meta.get(name)
        meta[name] = logprobs + (own if isinstance(own, list) else [])


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


def event_payload(event: bytes) -> Any:
    """The JSON of an SSE ``data:`` event; None for another event, ``[DONE]`` or data that is
    not JSON."""
    if not event.startswith(b"data:"):
        return None
    data = event[5:].strip()
    if data == b"[DONE]":
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def merge_event(event: bytes, prefill: PrefillLogprobs) -> bytes:
    """One SSE event (``data: {...}\\n\\n``) with the prefill's logprobs prepended."""
    parsed = event_payload(event)
    if parsed is None:
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
