"""``pd-router status``, ``convert`` and ``autopilot`` against a router that does not answer:
one line naming the url the command tried. Real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PD_ROUTER = str(Path(sys.executable).with_name("pd-router"))


@pytest.mark.parametrize(
    ("command", "path"),
    [
        (["status"], "/workers"),
        (["autopilot"], "/autopilot"),
        (["convert", "http://127.0.0.1:9/"], "/convert_pd_role"),
    ],
)
def test_unreachable_router_is_named_with_the_url_tried(free_port, command, path):
    router = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [PD_ROUTER, *command, "--router", router],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"router not reachable at {router}{path}" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
