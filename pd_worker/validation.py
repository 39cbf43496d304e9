"""Request validation as FastAPI and pydantic perform it in front of SGLang 0.5.23's routes.

SGLang declares each route's body as a type (``GenerateReqInput``, a dataclass; msgspec
structs such as ``PdRoleSwitchReqInput``); FastAPI validates the parsed JSON against it in
pydantic's lax mode and SGLang's handler answers a failure 400 with ``ErrorResponse`` whose
message is ``f"{exc} {exc.errors()}"``. The validators here rebuild those errors (type, loc,
msg, input, ctx) for the fields the worker reads, so a client sees the messages it would see on
SGLang; only FastAPI's endpoint context (the handler's file and line) is left out of the text.
Lax coercions are returned, so a value pydantic accepts (``"1.5"`` for a float) is used as it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from pd_protocol.json_values import is_int, is_number
from pd_worker.errors import InvalidBody

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Issue:
    """One pydantic error (an entry of ``exc.errors()``)."""

    type: str
    loc: Loc
    msg: str
    input: Any
    ctx: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "loc": self.loc, "msg": self.msg}
        out["input"] = self.input
        if self.ctx is not None:
            out["ctx"] = self.ctx
        return out


Result = tuple[Any, list[Issue]]
Validator = Callable[[Any, Loc], Result]

TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
BOOL_PARSING = "Input should be a valid boolean, unable to interpret input"
INT_PARSING = "Input should be a valid integer, unable to parse string as an integer"
FLOAT_PARSING = "Input should be a valid number, unable to parse string as a number"


def message(issues: list[Issue]) -> str:
    """The text SGLang's validation handler answers: ``str(exc)`` then ``exc.errors()``."""
    errors = [issue.as_dict() for issue in issues]
    plural = "s" if len(errors) != 1 else ""
    text = f"{len(errors)} validation error{plural}:\n" + "".join(f"  {e}\n" for e in errors)
    return f"{text.rstrip()} {errors}"


def parse_json(raw: bytes) -> Any:
    """A request body parsed as FastAPI parses one: an empty body is a missing body, and
    invalid JSON is reported with the stdlib decoder's message and position."""
    if not raw:
        raise InvalidBody(message([Issue("missing", ("body",), "Field required", None)]))
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        position = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason
        issue = Issue(
            "json_invalid", ("body", position), "JSON decode error", {}, {"error": reason}
        )
        raise InvalidBody(message([issue])) from None


def raise_if(issues: list[Issue]) -> None:
    if issues:
        raise InvalidBody(message(issues))


def string(value: Any, loc: Loc) -> Result:
    if isinstance(value, str):
        return value, []
    return value, [Issue("string_type", loc, "Input should be a valid string", value)]


def boolean(value: Any, loc: Loc) -> Result:
    if isinstance(value, bool):
        return value, []
    if is_number(value) and value in (0, 1):
        return bool(value), []
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS, []
    kind = "bool_parsing" if isinstance(value, str) or is_int(value) else "bool_type"
    text = BOOL_PARSING if kind == "bool_parsing" else "Input should be a valid boolean"
    return value, [Issue(kind, loc, text, value)]


def integer(value: Any, loc: Loc) -> Result:
    if isinstance(value, int):
        return int(value), []
    if isinstance(value, float):
        if value.is_integer():
            return int(value), []
        text = "Input should be a valid integer, got a number with a fractional part"
        return value, [Issue("int_from_float", loc, text, value)]
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
        if number is not None and number.is_integer() and "e" not in value.lower():
            return int(number), []
        return value, [Issue("int_parsing", loc, INT_PARSING, value)]
    return value, [Issue("int_type", loc, "Input should be a valid integer", value)]


def number(value: Any, loc: Loc) -> Result:
    if isinstance(value, int | float):
        return float(value), []
    if isinstance(value, str):
        try:
            return float(value.strip()), []
        except ValueError:
            return value, [Issue("float_parsing", loc, FLOAT_PARSING, value)]
    return value, [Issue("float_type", loc, "Input should be a valid number", value)]


def dictionary(value: Any, loc: Loc) -> Result:
    if isinstance(value, dict):
        return value, []
    return value, [Issue("dict_type", loc, "Input should be a valid dictionary", value)]


def any_value(value: Any, loc: Loc) -> Result:
    """A value whose own checks come later (chat messages: the chat layer reads them)."""
    return value, []


def exact_ints(value: Any) -> bool:
    """Whether ``value`` is a list of plain ints: a prompt's token ids, valid as they are. The
    per-item validators would take ~15 ms for an 8000-token prompt (and twice that in the
    ``list[list[int]] | list[int]`` union, whose first member fails on every item)."""
    return type(value) is list and all(type(entry) is int for entry in value)


def list_of(item: Validator) -> Validator:
    def check(value: Any, loc: Loc) -> Result:
        if item is integer and exact_ints(value):
            return value, []
        if not isinstance(value, list):
            return value, [Issue("list_type", loc, "Input should be a valid list", value)]
        out, issues = [], []
        for index, entry in enumerate(value):
            coerced, found = item(entry, (*loc, index))
            out.append(coerced)
            issues.extend(found)
        return out, issues

    return check


def nullable(item: Validator) -> Validator:
    def check(value: Any, loc: Loc) -> Result:
        return (None, []) if value is None else item(value, loc)

    return check


def literal(*choices: str) -> Validator:
    expected = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"

    def check(value: Any, loc: Loc) -> Result:
        if isinstance(value, str) and value in choices:
            return value, []
        issue = Issue(
            "literal_error", loc, f"Input should be {expected}", value, {"expected": expected}
        )
        return value, [issue]

    return check


def union(*members: tuple[str, Validator]) -> Validator:
    """Pydantic's union: the first member that accepts the value; otherwise every member's
    errors, each under the member's tag."""

    def check(value: Any, loc: Loc) -> Result:
        issues: list[Issue] = []
        for tag, member in members:
            coerced, found = member(value, (*loc, tag))
            if not found:
                return coerced, []
            issues.extend(found)
        return value, issues

    return check


Fields = tuple[tuple[str, Validator], ...]


def check_fields(body: dict[str, Any], fields: Fields, loc: Loc) -> Result:
    """Validate the declared fields present in ``body`` (others are ignored, as on SGLang);
    returns the declared fields with their coerced values."""
    out: dict[str, Any] = {}
    issues: list[Issue] = []
    for name, validator in fields:
        if name in body:
            out[name], found = validator(body[name], (*loc, name))
            issues.extend(found)
    return out, issues


def dataclass_body(body: Any, class_name: str, fields: Fields) -> dict[str, Any]:
    """A body declared as a dataclass (``GenerateReqInput``)."""
    if not isinstance(body, dict):
        text = f"Input should be a dictionary or an instance of {class_name}"
        raise_if([Issue("dataclass_type", ("body",), text, body, {"class_name": class_name})])
    out, issues = check_fields(body, fields, ("body",))
    raise_if(issues)
    return out


def struct_body(body: Any, class_name: str, fields: Fields) -> dict[str, Any]:
    """A body declared as a msgspec struct: SGLang validates it as an instance of the class or
    a dict built into one, so every failure also reports the failed instance check."""
    instance = Issue(
        "is_instance_of",
        ("body", f"is-instance[{class_name}]"),
        f"Input should be an instance of {class_name}",
        body,
        {"class": class_name},
    )
    built: Loc = ("body", f"function-after[build_struct(), {class_name}]")
    if not isinstance(body, dict):
        raise_if([instance, Issue("dict_type", built, "Input should be a valid dictionary", body)])
    out, issues = check_fields(body, fields, built)
    if issues:
        raise_if([instance, *issues])
    return out


OPTIONAL_STR = nullable(string)
# BaseReq's fields, which every msgspec request struct declares first.
BASE_REQ_FIELDS: Fields = (("rid", OPTIONAL_STR), ("http_worker_ipc", OPTIONAL_STR))

PD_ROLE_SWITCH_FIELDS: Fields = (
    *BASE_REQ_FIELDS,
    ("new_role", literal("prefill", "decode", "")),
    ("decode_cuda_graph_bs", nullable(list_of(integer))),
    ("decode_cuda_graph_memory_gb", nullable(number)),
    ("prepare_only", boolean),
)

_STR_OR_LIST = nullable(union(("str", string), ("list[str]", list_of(string))))
_INT_LIST = list_of(integer)
_NULLABLE_INTS = ("list[nullable[int]]", list_of(nullable(integer)))
_INPUT_IDS = union(("list[list[int]]", list_of(_INT_LIST)), ("list[int]", _INT_LIST))


def input_ids(value: Any, loc: Loc) -> Result:
    """``input_ids``: one prompt's token ids are accepted at once; anything else goes through
    the union (a batch, or a value to report errors on)."""
    if exact_ints(value):
        return value, []
    return _INPUT_IDS(value, loc)


GENERATE_FIELDS: Fields = (
    ("rid", _STR_OR_LIST),
    ("text", _STR_OR_LIST),
    ("input_ids", nullable(input_ids)),
    (
        "sampling_params",
        nullable(
            union(("list[dict[str,any]]", list_of(dictionary)), ("dict[str,any]", dictionary))
        ),
    ),
    ("return_logprob", nullable(union(("list[bool]", list_of(boolean)), ("bool", boolean)))),
    ("logprob_start_len", nullable(union(("list[int]", _INT_LIST), ("int", integer)))),
    ("top_logprobs_num", nullable(union(("list[int]", _INT_LIST), ("int", integer)))),
    ("return_text_in_logprobs", boolean),
    ("stream", boolean),
    (
        "bootstrap_host",
        nullable(union(("list[nullable[str]]", list_of(OPTIONAL_STR)), ("str", string))),
    ),
    ("bootstrap_port", nullable(union(_NULLABLE_INTS, ("int", integer)))),
    ("bootstrap_room", nullable(union(_NULLABLE_INTS, ("int", integer)))),
)


def positive(item: Validator, name: str) -> Validator:
    """``item`` then a ``field_validator`` refusing values <= 0 (SGLang's ``max_tokens``)."""

    def check(value: Any, loc: Loc) -> Result:
        coerced, issues = item(value, loc)
        if issues or coerced is None or coerced > 0:
            return coerced, issues
        error = ValueError(f"{name} must be positive")
        return value, [Issue("value_error", loc, f"Value error, {error}", value, {"error": error})]

    return check


def model_body(body: Any, fields: Fields, required: tuple[str, ...]) -> dict[str, Any]:
    """A body declared as a pydantic model (SGLang's OpenAI request types)."""
    if not isinstance(body, dict):
        text = "Input should be a valid dictionary or object to extract fields from"
        raise_if([Issue("model_attributes_type", ("body",), text, body)])
    issues: list[Issue] = []
    out: dict[str, Any] = {}
    for name, validator in fields:
        if name in body:
            out[name], found = validator(body[name], ("body", name))
            issues.extend(found)
        elif name in required:
            issues.append(Issue("missing", ("body", name), "Field required", body))
    raise_if(issues)
    return out


_ROOMS = nullable(union(("list[int]", _INT_LIST), ("int", integer)))
PD_ROUTING_FIELDS: Fields = (
    ("bootstrap_host", nullable(union(("list[str]", list_of(string)), ("str", string)))),
    ("bootstrap_port", nullable(union(_NULLABLE_INTS, ("int", integer)))),
    ("bootstrap_room", _ROOMS),
)
_OPTIONAL_INT = nullable(integer)
_RID = nullable(union(("list[str]", list_of(string)), ("str", string)))

COMPLETION_FIELDS: Fields = (
    *PD_ROUTING_FIELDS,
    ("model", string),
    (
        "prompt",
        union(
            ("list[int]", _INT_LIST),
            ("list[list[int]]", list_of(_INT_LIST)),
            ("str", string),
            ("list[str]", list_of(string)),
        ),
    ),
    ("logprobs", _OPTIONAL_INT),
    ("max_tokens", positive(integer, "max_tokens")),
    ("n", integer),
    ("stream", boolean),
    ("rid", _RID),
)

CHAT_FIELDS: Fields = (
    *PD_ROUTING_FIELDS,
    ("messages", list_of(any_value)),
    ("model", string),
    ("logprobs", boolean),
    ("top_logprobs", _OPTIONAL_INT),
    ("max_tokens", _OPTIONAL_INT),
    ("max_completion_tokens", _OPTIONAL_INT),
    ("n", integer),
    ("stream", boolean),
    ("rid", _RID),
)


def completion_body(body: Any) -> None:
    """FastAPI's validation of a ``/v1/completions`` body as ``CompletionRequest``."""
    model_body(body, COMPLETION_FIELDS, ("prompt",))


def chat_body(body: Any) -> None:
    """FastAPI's validation of a ``/v1/chat/completions`` body as ``ChatCompletionRequest``
    (the message entries themselves are checked later, by the chat layer)."""
    model_body(body, CHAT_FIELDS, ("messages",))


def generate_body(body: Any) -> None:
    """FastAPI's validation of a ``/generate`` body as ``GenerateReqInput``."""
    dataclass_body(body, "GenerateReqInput", GENERATE_FIELDS)


def pd_role_switch_body(body: Any) -> dict[str, Any]:
    """FastAPI's validation of a ``/pd_role_switch`` body as ``PdRoleSwitchReqInput``: the
    declared switch fields, coerced; unknown fields are dropped, as msgspec decoding drops them."""
    fields = struct_body(body, "PdRoleSwitchReqInput", PD_ROLE_SWITCH_FIELDS)
    for name, _ in BASE_REQ_FIELDS:
        fields.pop(name, None)
    return fields
