"""``pd-router demo`` runs end to end: every answer checked, exit code 0."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest

from pd_router.cli.demo import main


@pytest.fixture(autouse=True)
def router_logger_restored() -> Iterator[None]:
    """The demo configures the ``pd_router`` logger for its terminal; the tests after it
    capture that logger's records as they found it."""
    logger = logging.getLogger("pd_router")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


def test_demo_runs_its_steps_and_every_answer_is_right(capsys):
    assert main(["--requests", "25", "--concurrency", "4", "--speed", "0"]) == 0
    out = capsys.readouterr().out
    assert "25  ok (output matches its prefill's KV)" in out
    assert re.search(r"== summary: \d+ requests, 0 not ok", out)
