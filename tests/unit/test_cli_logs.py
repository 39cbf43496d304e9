"""The text log format (``--log-format text``): one line a record with the extra fields the
message does not already say, a traceback after it."""

from __future__ import annotations

import logging
import sys

from pd_router.cli.logs import TextFormatter


def formatted(message: str, *args: object, exc_info=None, **extra: object) -> str:
    record = logging.makeLogRecord(
        {"msg": message, "args": args, "levelname": "WARNING", "name": "pd_router.x",
         "exc_info": exc_info, **extra}
    )  # fmt: skip
    return TextFormatter("%(levelname)s %(name)s: %(message)s").format(record)


def test_a_field_the_message_already_says_is_not_repeated():
    line = formatted(
        "worker %s unhealthy (%s)", "http://w:1", "connection refused",
        worker="http://w:1", role="decode", error="connection refused",
    )  # fmt: skip
    said = "worker http://w:1 unhealthy (connection refused)"
    assert line == f"WARNING pd_router.x: {said} role=decode"


def test_the_fields_come_before_a_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        line = formatted("unhandled error", exc_info=sys.exc_info(), request_id="r1")
    first, *rest = line.splitlines()
    assert first == "WARNING pd_router.x: unhandled error request_id=r1"
    assert rest[-1] == "ValueError: boom"
