"""``pd-router convert`` while the worker drains: the conversion id at once, then the phase,
the requests in flight and the worker's load once a second (a progress bar on a terminal, plain
lines otherwise); Ctrl-C asks whether to abort on a terminal and otherwise leaves the
conversion running and prints the command that aborts it (``pd-router convert --abort ID``)."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import time

import pytest

from tests.cli_process import PD_ROUTER, environment, run
from tests.conversion_helpers import arranged_router, conversion_status, pools, wait_for_busy
from tests.router_helpers import wait_until

# Real decode steps (10 ms per token), so a long generation holds its decode for seconds.
SPEED = 1.0
# About 3 s of decoding: long enough for a few progress lines, short enough for a test.
SHORT_DRAIN_TOKENS = 300
# Far longer than any of these tests: a drain that only an abort ends.
ENDLESS_TOKENS = 100_000
INTERRUPTED = 130


@pytest.fixture(scope="module")
def cluster(module_cluster_factory):
    return module_cluster_factory(prefill=1, decode=2, speed=SPEED)


@pytest.fixture
async def router(cluster):
    async with arranged_router(cluster, prefill=1) as r:
        yield r


async def busy_decode(router, tokens: int) -> tuple[asyncio.Task, str]:
    """A generation holding one decode for ``tokens`` steps, and that decode's url."""
    body = {"text": "hold the decode", "sampling_params": {"max_new_tokens": tokens}}

    async def hold() -> None:
        async with router.client(timeout=600.0) as http:
            await http.post("/generate", json=body)

    task = asyncio.create_task(hold())
    async with router.client() as admin:
        decode = await wait_for_busy((await pools(admin))["decode"])
    return task, decode


def start_convert(*args: str, **streams: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PD_ROUTER, "convert", *args], env=environment(), **streams)


def conversion_id(first_line: str) -> str:
    match = re.search(r"conversion (\S+) started", first_line)
    assert match, first_line
    return match.group(1)


async def read_line(process: subprocess.Popen[bytes], within: float = 20.0) -> str:
    line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), within)
    return line.decode()


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


async def test_convert_prints_the_id_at_once_then_the_drain_every_second(router):
    task, decode = await busy_decode(router, SHORT_DRAIN_TOKENS)
    process = start_convert(decode, "--router", router.url, stdout=subprocess.PIPE)
    try:
        first = await read_line(process)
        async with router.client() as http:
            assert await conversion_status(http, conversion_id(first)) == "draining"
        rest, _ = await asyncio.to_thread(process.communicate, timeout=60)
    finally:
        stop(process)
        task.cancel()
    assert process.returncode == 0
    lines = rest.decode().splitlines()
    draining = [line for line in lines if "draining" in line]
    assert len(draining) >= 2, lines
    assert "in-flight 1" in draining[0]
    assert re.search(r"worker load [1-9]\d* tokens", draining[0]), draining[0]
    assert "\r" not in rest.decode()
    assert "decode -> prefill: succeeded" in lines[-3]


async def test_on_a_terminal_a_progress_bar_and_ctrl_c_asks_whether_to_abort(router):
    task, decode = await busy_decode(router, ENDLESS_TOKENS)
    leader, follower = pty.openpty()
    process = start_convert(
        decode, "--router", router.url, stdin=follower, stdout=follower, stderr=follower
    )
    os.close(follower)
    screen = Screen(leader)
    try:
        await screen.wait_for(r"\r\x1b\[K\[[#.]+\] draining")
        conv = conversion_id(screen.text)
        process.send_signal(signal.SIGINT)
        await screen.wait_for(rf"[Aa]bort conversion {conv}\? \[y/N\]")
        os.write(leader, b"y\n")
        await asyncio.to_thread(process.wait, 30)
        await screen.wait_for("aborted")
        async with router.client() as http:
            assert await conversion_status(http, conv) == "aborted"
            await wait_until(lambda: decode_back(http, decode), 10, "decode back in its pool")
    finally:
        stop(process)
        task.cancel()
        os.close(leader)
    assert "Traceback" not in screen.text
    assert process.returncode == 1


async def decode_back(http, url: str) -> bool:
    return url in (await pools(http))["decode"]


async def test_ctrl_c_without_a_terminal_leaves_it_running_and_prints_the_abort_command(router):
    task, decode = await busy_decode(router, ENDLESS_TOKENS)
    process = start_convert(
        decode, "--router", router.url, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        conv = conversion_id(await read_line(process))
        await read_line(process)
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.to_thread(process.communicate, timeout=30)
        err_text = err.decode()
        assert process.returncode == INTERRUPTED
        assert "Traceback" not in err_text
        async with router.client() as http:
            assert await conversion_status(http, conv) == "draining"
        command = next(line for line in err_text.splitlines() if "--abort" in line).strip()
        assert command.startswith("pd-router convert --abort " + conv)
        result = await asyncio.to_thread(run, PD_ROUTER, *shlex.split(command)[1:])
        assert result.returncode == 0, result.stderr
        assert "aborted" in result.stdout
        async with router.client() as http:
            assert await conversion_status(http, conv) == "aborted"
    finally:
        stop(process)
        task.cancel()


class Screen:
    """What a terminal shows: everything a process wrote to the pty so far."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""

    async def wait_for(self, pattern: str, within: float = 20.0) -> None:
        deadline = time.monotonic() + within
        while not re.search(pattern, self.text):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in {self.text!r}"
            readable, _, _ = await asyncio.to_thread(select.select, [self.fd], [], [], left)
            if not readable:
                continue
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:
                chunk = b""
            assert chunk or re.search(pattern, self.text), f"no {pattern!r} in {self.text!r}"
            self.text += chunk.decode(errors="replace")
