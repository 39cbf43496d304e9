"""Request bodies as the router reads them: item counting (SGLang's batch rules), bootstrap
injection and the rids a request is aborted by."""

from __future__ import annotations

import pytest

from pd_router.control.workers import Role, WorkerRegistry
from pd_router.dataplane.path.requests import (
    CHAT,
    COMPLETIONS,
    GENERATE,
    chat_items,
    completion_items,
    generate_items,
    inject_bootstrap,
    logprobs_requested,
    parse_body,
    router_rid,
)
from pd_router.errors import BadRequest
from pd_router.metrics import RouterMetrics


@pytest.mark.parametrize(
    ("body", "items"),
    [
        ({"text": "one"}, (None, 1)),
        ({"text": ["a", "b", "c"]}, (3, 1)),
        ({"input_ids": [1, 2, 3]}, (None, 1)),
        ({"input_ids": [[1], [2, 3]]}, (2, 1)),
        ({"text": "one", "sampling_params": {"n": 4}}, (4, 4)),
        ({"text": ["a", "b"], "sampling_params": {"n": 3}}, (6, 3)),
        ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, (4, 2)),
    ],
)
def test_generate_items_follow_sglang_batch_rules(body, items):
    assert generate_items(body) == items


@pytest.mark.parametrize(
    ("body", "items"),
    [
        ({"prompt": "one"}, (None, 1)),
        ({"prompt": ["a", "b"]}, (2, 1)),
        ({"prompt": [5, 6, 7]}, (None, 1)),
        ({"prompt": [[5], [6, 7]], "n": 2}, (4, 2)),
    ],
)
def test_completion_items_count_prompt_lists_and_n(body, items):
    assert completion_items(body) == items


def test_chat_items_count_n():
    messages = [{"role": "user", "content": "hi"}]
    assert chat_items({"messages": messages}) == (None, 1)
    assert chat_items({"messages": messages, "n": 3}) == (3, 3)


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[]", b"3", b"null", b'"x"', b"\xff"], ids=lambda r: repr(r)
)
def test_only_a_json_object_is_a_body(raw):
    with pytest.raises(BadRequest):
        parse_body(raw)


@pytest.fixture
def prefill():
    registry = WorkerRegistry(RouterMetrics())
    return registry.add("http://[::1]:30000", Role.PREFILL, 9001)


def test_single_request_gets_scalar_bootstrap_fields_with_ipv6_in_brackets(prefill):
    body = {"text": "x"}
    inject_bootstrap(body, prefill, None)
    assert body["bootstrap_host"] == "[::1]"
    assert body["bootstrap_port"] == 9001
    assert 0 <= body["bootstrap_room"] < 2**63


def test_batch_gets_one_distinct_room_per_item(prefill):
    body = {"text": ["a", "b", "c"]}
    inject_bootstrap(body, prefill, 3)
    assert body["bootstrap_host"] == ["[::1]"] * 3
    assert body["bootstrap_port"] == [9001] * 3
    assert len(set(body["bootstrap_room"])) == 3


def test_new_attempt_gets_new_rooms(prefill):
    body = {"text": "x"}
    inject_bootstrap(body, prefill, None)
    first = body["bootstrap_room"]
    inject_bootstrap(body, prefill, None)
    assert body["bootstrap_room"] != first


def test_rids_the_router_assigns_and_aborts_by():
    assert router_rid(GENERATE, "r1", None) == ("r1", ["r1"])
    assert router_rid(GENERATE, "r1", 2) == (["r1_0", "r1_1"], ["r1_0", "r1_1"])
    assert router_rid(COMPLETIONS, "r1", 2) == ("r1", ["r1_0", "r1_1"])
    assert router_rid(CHAT, "r1", None) == ("r1", ["r1"])


@pytest.mark.parametrize(
    ("value", "expected"), [(1, True), (0, False), ("true", True), ("No", False), ("yes", True)]
)
def test_openai_stream_flag_is_read_as_pydantic_reads_it(value, expected):
    body = {"prompt": "x", "stream": value}
    completion_items(body)
    assert body["stream"] is expected


@pytest.mark.parametrize("value", [2, -1, "maybe", 1.5, [], {}])
def test_openai_stream_flag_pydantic_would_reject_is_a_bad_request(value):
    with pytest.raises(BadRequest):
        chat_items({"messages": [{"role": "user", "content": "hi"}], "stream": value})


@pytest.mark.parametrize("value", [1, "true", "yes"])
def test_generate_stream_flag_must_be_a_json_boolean(value):
    with pytest.raises(BadRequest, match="'stream'"):
        generate_items({"text": "x", "stream": value})


def test_generate_return_logprob_may_be_one_flag_per_item():
    assert generate_items({"text": ["a", "b"], "return_logprob": [False, True]}) == (2, 1)
    assert logprobs_requested([False, True])
    assert not logprobs_requested([False, False])


@pytest.mark.parametrize("value", ["true", 1, [1], {}])
def test_generate_return_logprob_of_another_type_is_a_bad_request(value):
    with pytest.raises(BadRequest, match="'return_logprob'"):
        generate_items({"text": "x", "return_logprob": value})


@pytest.mark.parametrize(
    "body",
    [
        {"text": "x", "sampling_params": {"n": 10**8}},
        {"text": ["a"] * 300, "sampling_params": {"n": 300}},
    ],
)
def test_fan_out_beyond_the_item_limit_is_a_bad_request(body):
    with pytest.raises(BadRequest, match="at most"):
        generate_items(body)


def test_huge_n_on_completions_is_a_bad_request():
    with pytest.raises(BadRequest, match="at most"):
        completion_items({"prompt": "x", "n": 10**9})


@pytest.mark.parametrize("value", [2.0, "2", " 2 "])
def test_openai_n_is_read_as_pydantic_reads_an_int(value):
    body = {"prompt": "x", "n": value}
    assert completion_items(body) == (2, 2)
    assert body["n"] == 2 and isinstance(body["n"], int)


@pytest.mark.parametrize("value", [1.5, "two", "-2", True, [2]])
def test_openai_n_that_is_no_integer_is_a_bad_request(value):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(BadRequest, match="'n'"):
        chat_items({"messages": messages, "n": value})
