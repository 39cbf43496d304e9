"""Client request bodies: parsing once, checking the fields the router relies on, counting the
items of a batch, and injecting the bootstrap fields.

The router only checks what it must understand to route (the inputs that decide the batch size,
``n``, ``stream``, ``return_logprob``, ``rid``); everything else is the worker's business and is
passed through untouched. Counting follows SGLang's ``GenerateReqInput`` normalisation: a list of
texts, a 2-D ``input_ids`` or a 3-D ``input_embeds`` is a batch, ``n > 1`` multiplies it (and
sends the request through :mod:`pd_router.dataplane.path.fanout`), and a batch gets one bootstrap
room per prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pd_protocol.json_values import is_int
from pd_router.dataplane.routing.target import Target
from pd_router.errors import BadRequest
from pd_router.roles import DEFAULT_BOOTSTRAP_PORT

# Deepest nesting orjson serialises: the router re-serialises every body it forwards, so a body
# nested deeper cannot be routed (orjson parses up to 1024 levels).
MAX_NESTING = 254


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; BadRequest for anything else, including a body
    nested deeper than the router can serialise again."""
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    check_nesting(raw, body)
    return body


def parse_admin_body(raw: bytes) -> dict[str, Any]:
    """An admin call's JSON object (``/convert_pd_role``, ``PUT /autopilot``, ...): an empty
    body means no fields; anything else is checked as :func:`parse_body` checks it."""
    return parse_body(raw) if raw else {}


def check_nesting(raw: bytes, body: dict[str, Any]) -> None:
    """BadRequest when ``body`` is nested deeper than :data:`MAX_NESTING`. Nesting is at most
    the number of opening brackets; only a body with more of them than that (a long chat, a
    2-D ``input_ids``) is serialised once to be sure."""
    if not more_brackets_than(raw, MAX_NESTING):
        return
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise BadRequest(f"request body is nested more than {MAX_NESTING} levels deep") from None


def more_brackets_than(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` has more than ``limit`` opening brackets. ``bytes.find`` runs at memchr
    speed and stops counting at ``limit``: a tenth of what ``bytes.count`` costs on a large
    prompt, where brackets are few."""
    count = 0
    for bracket in (b"[", b"{"):
        position = raw.find(bracket)
        while position != -1:
            count += 1
            if count > limit:
                return True
            position = raw.find(bracket, position + 1)
    return False


# The strings pydantic's lax mode (SGLang's OpenAI request models) reads as booleans.
TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})

# Most items (prompts x samples) one request may fan out to: each gets a bootstrap room the
# router draws and serialises, so a huge ``n`` would stall the router before any worker saw it.
MAX_BATCH_ITEMS = 65536


def check_optional(body: dict[str, Any], key: str, kind: type, what: str) -> None:
    """``body[key]``, when present and not null, must be of ``kind`` (a bool is not an int)."""
    value = body.get(key)
    if value is None:
        return
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise BadRequest(f"'{key}' must be {what}, got {type(value).__name__}")


def normalize_bool(body: dict[str, Any], key: str) -> None:
    """Replace ``body[key]`` by the boolean SGLang's OpenAI models read it as (pydantic's lax
    rules: ``1``, ``"true"``, ``"yes"``... are true), so the router streams exactly when the
    worker does; BadRequest for a value SGLang would reject."""
    value = body.get(key)
    if value is None or isinstance(value, bool):
        return
    if is_int(value) and value in (0, 1):
        body[key] = bool(value)
    elif isinstance(value, str) and value.lower() in TRUE_WORDS | FALSE_WORDS:
        body[key] = value.lower() in TRUE_WORDS
    else:
        raise BadRequest(f"'{key}' must be a boolean, got {type(value).__name__} {value!r}")


def check_rid(body: dict[str, Any]) -> None:
    rid = body.get("rid")
    if rid is not None and not (
        isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
    ):
        raise BadRequest("'rid' must be a string or a list of strings")


def check_n(value: Any) -> int:
    if value is None:
        return 1
    if not is_int(value) or value < 1:
        raise BadRequest(f"'n' must be an integer >= 1, got {value!r}")
    return value


def normalize_openai_n(body: dict[str, Any]) -> int:
    """The OpenAI ``n``, read as SGLang's pydantic model reads an int (``2.0`` and ``"2"`` are
    2) and written back as an int; BadRequest for anything else."""
    value = body.get("n")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    n = check_n(value)
    if "n" in body and body["n"] is not None:
        body["n"] = n
    return n


def token_list_kind(value: Any, key: str) -> int | None:
    """None for a flat list of token ids, the row count for a list of such lists."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{key}' must be a non-empty list of token ids or of such lists")
    first = value[0]
    if is_int(first):
        return None
    if isinstance(first, list) and all(isinstance(row, list) and row for row in value):
        if not is_int(first[0]):
            raise BadRequest(f"'{key}' rows must hold integer token ids")
        return len(value)
    raise BadRequest(f"'{key}' must be a non-empty list of token ids or of such lists")


def string_list_kind(value: Any, key: str) -> int | None:
    """None for a string, the length for a non-empty list of strings."""
    if isinstance(value, str):
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return len(value)
    raise BadRequest(f"'{key}' must be a string or a non-empty list of strings")


Items = tuple[int | None, int]
"""(item count, None for a single item; samples per prompt ``n``)."""


def scaled(batch: int | None, n: int) -> Items:
    """Items of a batch of ``batch`` prompts with ``n`` samples each."""
    if (batch or 1) * n > MAX_BATCH_ITEMS:
        raise BadRequest(
            f"a request may fan out to at most {MAX_BATCH_ITEMS} items (prompts x n), "
            f"got {batch or 1} x {n}"
        )
    if n > 1:
        return (batch or 1) * n, n
    return batch, n


def logprobs_requested(value: Any) -> bool:
    """Whether ``return_logprob`` (a boolean, or one per item of a batch) asks for any."""
    return any(value) if isinstance(value, list) else value is True


def generate_items(body: dict[str, Any]) -> Items:
    """Items of a native /generate request. SGLang's contract gate takes only JSON booleans
    here: ``stream`` a boolean, ``return_logprob`` a boolean or a list of them."""
    check_rid(body)
    check_optional(body, "stream", bool, "a boolean")
    flags = body.get("return_logprob")
    if not (
        flags is None
        or isinstance(flags, bool)
        or (isinstance(flags, list) and all(isinstance(f, bool) for f in flags))
    ):
        raise BadRequest("'return_logprob' must be a boolean or a list of booleans")
    if body.get("text") is not None:
        batch = string_list_kind(body["text"], "text")
    elif body.get("input_ids") is not None:
        batch = token_list_kind(body["input_ids"], "input_ids")
    elif body.get("input_embeds") is not None:
        embeds = body["input_embeds"]
        if not isinstance(embeds, list) or not embeds or not isinstance(embeds[0], list):
            raise BadRequest("'input_embeds' must be a non-empty list of embedding vectors")
        batch = len(embeds) if embeds[0] and isinstance(embeds[0][0], list) else None
    else:
        raise BadRequest("one of 'text', 'input_ids' or 'input_embeds' is required")
    params = body.get("sampling_params")
    if params is None:
        n = 1
    elif isinstance(params, dict):
        n = check_n(params.get("n"))
    elif isinstance(params, list) and all(isinstance(p, dict) for p in params):
        n = check_n(params[0].get("n")) if params else 1
    else:
        raise BadRequest("'sampling_params' must be an object or a list of objects")
    return scaled(batch, n)


def completion_items(body: dict[str, Any]) -> Items:
    """Items of an OpenAI /v1/completions request."""
    check_rid(body)
    normalize_bool(body, "stream")
    check_optional(body, "model", str, "a string")
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required")
    if isinstance(prompt, str):
        batch = None
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        batch = string_list_kind(prompt, "prompt")
    else:
        batch = token_list_kind(prompt, "prompt")
    return scaled(batch, normalize_openai_n(body))


def chat_items(body: dict[str, Any]) -> Items:
    """Items of an OpenAI /v1/chat/completions request."""
    check_rid(body)
    normalize_bool(body, "stream")
    check_optional(body, "model", str, "a string")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects")
    if not all(isinstance(m, dict) for m in messages):
        raise BadRequest("each entry of 'messages' must be an object")
    return scaled(None, normalize_openai_n(body))


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A generation endpoint: its route, how to count its items, and whether it is SGLang's
    native API (which merges logprobs and takes one rid per prompt) or an OpenAI one."""

    name: str
    path: str
    count_items: Callable[[dict[str, Any]], Items]
    native: bool


GENERATE = Endpoint("generate", "/generate", generate_items, native=True)
COMPLETIONS = Endpoint("completions", "/v1/completions", completion_items, native=False)
CHAT = Endpoint("chat_completions", "/v1/chat/completions", chat_items, native=False)


def inject_bootstrap(body: dict[str, Any], prefill: Target, items: int | None) -> None:
    """Point the decode at ``prefill`` with fresh random 63-bit rooms, one per item of a batch.
    A request never carries ``n > 1`` here: :mod:`pd_router.dataplane.path.fanout` sends its samples
    as requests of their own."""
    host = prefill.bootstrap_host
    port = prefill.bootstrap_port or DEFAULT_BOOTSTRAP_PORT
    if items is None:
        body["bootstrap_host"] = host
        body["bootstrap_port"] = port
        body["bootstrap_room"] = random.getrandbits(63)
        return
    body["bootstrap_host"] = [host] * items
    body["bootstrap_port"] = [port] * items
    body["bootstrap_room"] = [random.getrandbits(63) for _ in range(items)]


def item_rids(rid: str | list[str], items: int | None) -> list[str]:
    """The rids a worker knows a request by: SGLang expands a string rid to ``rid_i`` for each
    item of a batch."""
    if isinstance(rid, list):
        return rid
    if items is None:
        return [rid]
    return [f"{rid}_{i}" for i in range(items)]


def router_rid(
    endpoint: Endpoint, base: str, items: int | None
) -> tuple[str | list[str], list[str]]:
    """The rid the router gives a request that came without one and the rids to abort it by:
    a native batch gets one rid per prompt, anything else ``base`` (which SGLang expands to
    ``base_i`` for the items of an OpenAI batch)."""
    rids = item_rids(base, items)
    if items is None or not endpoint.native:
        return base, rids
    return rids, rids
