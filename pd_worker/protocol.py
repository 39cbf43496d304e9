"""SGLang's native ``/generate`` protocol: request bodies to items, progress to response dicts."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pd_protocol.json_values import is_int
from pd_worker import logprobs
from pd_worker.errors import BadRequest, ContractError
from pd_worker.requests import GenItem, Progress
from pd_worker.tokens import tokenize

Tokenize = Callable[[str], list[int]]

DEFAULT_MAX_NEW_TOKENS = 128
MAX_TOKEN_ID = 2**31 - 1
MAX_ROOM = 2**64 - 1
# Odd 64-bit constant (2**64 / golden ratio) that spreads the samples' transfer keys apart.
SAMPLE_ROOM_STRIDE = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request, before parallel-sampling expansion."""

    ids: list[int]
    sampling: dict[str, Any]


def new_rid() -> str:
    return uuid.uuid4().hex


def parse_generate(
    body: dict[str, Any], tokenizer: Tokenize = tokenize
) -> tuple[list[GenItem], bool, bool]:
    """Items of a ``/generate`` body (an object, as its validation ensured), whether it is a
    batch, and whether it streams; ``tokenizer`` turns a text prompt into the engine's ids."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ContractError(f"invalid type: {serde_unexpected(stream)}, expected a boolean")
    prompts, batch = _prompts(body, tokenizer)
    n = _sampling_n(prompts)
    batch = batch or n > 1
    rids = item_rids(body.get("rid"), len(prompts), n, batch)
    items = build_items(body, prompts, n, rids)
    return items, batch, wants_stream(body)


def serde_unexpected(value: Any) -> str:
    """How SGLang's contract gate (serde's ``Unexpected``) names a JSON value of the wrong type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def wants_stream(body: Any) -> bool:
    """Whether a ``/generate`` body asks for a stream (also read when its other fields fail);
    SGLang's contract gate takes only a JSON boolean there, not ``1`` or ``"true"``."""
    return isinstance(body, dict) and body.get("stream") is True


def item_rids(rid: Any, prompts: int, n: int, batch: bool) -> list[str]:
    """The rid of each item (prompt-major, ``n`` per prompt), assigned as SGLang 0.5.23 does.

    ``GenerateReqInput._normalize_rid``: a single request keeps its string rid; a batch expands
    a string to ``{rid}_{i}`` for each item, takes a list with one unique rid per prompt, and
    draws fresh ids without one. With ``n > 1`` the tokenizer manager then gives every sample a
    fresh rid (the client's rids only name the prefix warm-up), so samples get fresh ids here.
    """
    if not batch:
        if rid is None or isinstance(rid, str):
            return [new_rid() if rid is None else rid]
        raise BadRequest("The rid should be a string for a single request.")
    total = prompts * n
    if rid is None:
        rids = [new_rid() for _ in range(total)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(total)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != prompts:
            raise BadRequest(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = list(rid)
    else:
        raise ContractError("The rid should be a string or a list of strings.")
    duplicates = sorted({r for r in rids if rids.count(r) > 1})
    if duplicates:
        raise BadRequest(f"Duplicate request IDs detected within the request: {duplicates}")
    return rids if n == 1 else [new_rid() for _ in range(total)]


def build_items(
    body: dict[str, Any], prompts: list[Prompt], n: int, rids: list[str]
) -> list[GenItem]:
    """Expand prompts by ``n`` (prompt-major) and attach each item's bootstrap fields.

    Bootstrap fields are read per prompt, as SGLang 0.5.23 reads them: ``GenerateReqInput``
    repeats a list ``n`` times and the tokenizer manager takes entry ``i`` for prompt ``i``, so
    only the first entry of each prompt counts. Every sample of a prompt shares its room;
    :func:`sample_room` gives each sample its own transfer key, derived alike on both sides.
    """
    count = len(prompts)
    hosts = _per_prompt(body.get("bootstrap_host"), count, "bootstrap_host")
    ports = _per_prompt(body.get("bootstrap_port"), count, "bootstrap_port")
    rooms = _rooms(body.get("bootstrap_room"), count)
    flags = _logprob_param(body.get("return_logprob", False), count, n, "return_logprob")
    tops = _logprob_param(body.get("top_logprobs_num", 0), count, n, "top_logprobs_num")
    text = body.get("return_text_in_logprobs", False)
    items = []
    for index in range(count * n):
        p, sample = divmod(index, n)
        room = sample_room(rooms[p], sample)
        item = _item(prompts[p], rids[index], hosts[p], ports[p], room)
        items.append(_with_logprobs(item, flags[p], tops[p], text))
    return items


def sample_room(room: Any, sample: int) -> Any:
    """The transfer key of sample ``sample`` of a prompt whose bootstrap room is ``room``: the
    room itself for the first sample, a fixed odd multiple away (mod 2**64) for the others, so
    the samples of one prompt never share a transfer and both legs derive the same keys."""
    if sample == 0 or not is_int(room):
        return room
    return (room + sample * SAMPLE_ROOM_STRIDE) % (MAX_ROOM + 1)


def _rooms(room: Any, count: int) -> list[Any]:
    """One room per prompt; a scalar room on a batch counts up from it (``room + i``), as in
    SGLang's ``_normalize_bootstrap_params``."""
    if is_int(room) and count > 1:
        return [room + i for i in range(count)]
    return _per_prompt(room, count, "bootstrap_room")


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    """A scalar broadcast to every prompt, or a list read as SGLang indexes it: its first
    ``count`` entries (a shorter list cannot name every prompt)."""
    if isinstance(value, list):
        if len(value) < count:
            raise BadRequest(f"{name} has {len(value)} entries for {count} prompts")
        return value[:count]
    return [value] * count


def _logprob_param(value: Any, count: int, n: int, name: str) -> list[Any]:
    """A logprob parameter per prompt; SGLang refuses a list of them with parallel sampling."""
    if isinstance(value, list) and n > 1:
        raise BadRequest(f"Cannot use list {name} with parallel_sample_num > 1")
    return _per_item(value, count, name)


def _with_logprobs(item: GenItem, flag: Any, top: Any, text: Any) -> GenItem:
    if top is not None and not is_int(top):
        raise ContractError("top_logprobs_num must be an integer")
    return replace(
        item,
        return_logprob=bool(flag),
        top_logprobs_num=top or 0,
        return_text_in_logprobs=bool(text),
    )


def _item(prompt: Prompt, rid: str, host: Any, port: Any, room: Any) -> GenItem:
    if host is not None and not isinstance(host, str):
        raise ContractError("bootstrap_host must be a string")
    for name, value, high in (("bootstrap_port", port, 65535), ("bootstrap_room", room, MAX_ROOM)):
        if value is not None and not (is_int(value) and 0 <= value <= high):
            raise ContractError(f"{name} must be an integer in 0..{high}")
    sampling = prompt.sampling
    stop = sampling.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    stop_ids = sampling.get("stop_token_ids") or ()
    if not all(isinstance(s, str) for s in stop):
        raise ContractError("stop must be a string or a list of strings")
    if not all(isinstance(t, int) for t in stop_ids):
        raise ContractError("stop_token_ids must be a list of integers")
    return GenItem(
        rid=rid,
        prompt_ids=prompt.ids,
        max_new_tokens=_max_new_tokens(sampling),
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_ids),
        bootstrap_host=host.strip("[]") if isinstance(host, str) else None,
        bootstrap_port=port,
        bootstrap_room=room,
    )


def _max_new_tokens(sampling: dict[str, Any]) -> int:
    value = sampling.get("max_new_tokens")
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS
    if not is_int(value) or value < 0:
        raise ContractError("max_new_tokens must be a non-negative integer")
    return value


def _prompts(body: dict[str, Any], tokenizer: Tokenize) -> tuple[list[Prompt], bool]:
    text: Any = body.get("text")
    input_ids: Any = body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ContractError("text must be a string or a non-empty list of strings")
        ids_list = [tokenizer(t) for t in texts]
    else:
        if input_ids == []:
            raise BadRequest("input_ids cannot be empty.")
        batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        ids_list = input_ids if batch else [input_ids]
        if not all(_is_id_list(ids) for ids in ids_list):
            raise ContractError("input_ids must be a list of integers or a list of such lists")
    sampling = _per_item(body.get("sampling_params") or {}, len(ids_list), "sampling_params")
    if not all(isinstance(s, dict) for s in sampling):
        raise ContractError("sampling_params must be an object or a list of objects")
    return [Prompt(list(ids), s) for ids, s in zip(ids_list, sampling, strict=True)], batch


def is_token_id(value: Any) -> bool:
    return is_int(value) and 0 <= value <= MAX_TOKEN_ID


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_token_id(t) for t in value)


def _sampling_n(prompts: list[Prompt]) -> int:
    values = {p.sampling.get("n", 1) for p in prompts}
    if len(values) != 1:
        raise BadRequest("sampling_params.n must be the same for every prompt")
    n = values.pop()
    if not is_int(n) or n < 1:
        raise ContractError("sampling_params.n must be a positive integer")
    return n


def _per_item(value: Any, total: int, name: str) -> list[Any]:
    """A scalar broadcast to every item, or a list with exactly one entry per item."""
    if isinstance(value, list):
        if len(value) != total:
            raise BadRequest(f"{name} has {len(value)} entries for {total} items")
        return value
    return [value] * total


def response_dict(item: GenItem, progress: Progress, e2e_latency: float) -> dict[str, Any]:
    """One item's ``/generate`` output: text, output_ids and meta_info as SGLang builds them."""
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": progress.finish_reason,
        "prompt_tokens": len(item.prompt_ids),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(progress.output_ids),
        "cached_tokens": progress.cached_tokens,
    }
    if progress.finished:
        meta["e2e_latency"] = round(e2e_latency, 6)
    if progress.kv_source is not None:
        meta["kv_source"] = progress.kv_source
    if item.return_logprob:
        meta.update(logprobs.meta_fields(item, progress))
    return {"text": progress.text, "output_ids": list(progress.output_ids), "meta_info": meta}


def abort_progress(progress: Progress, message: str, status: int) -> Progress:
    """The last progress of an item aborted with a status (streams report it, then [DONE])."""
    finish = {"type": "abort", "message": message, "status_code": status, "err_type": None}
    return Progress(
        progress.output_ids, progress.text, finish, progress.kv_source, progress.cached_tokens
    )
