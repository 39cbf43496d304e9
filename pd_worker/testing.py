"""Helpers for tests that talk to reference workers directly (without a router).

:func:`pd_generate` does what a PD router does for one request: add the prefill's bootstrap
address and a fresh room to the body and send it to the prefill and the decode at once.
:func:`poll_until` waits for a condition on a worker with a deadline (never a fixed sleep).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

LOOPBACK = "127.0.0.1"
POLL_DEADLINE_SECS = 10.0
POLL_INTERVAL_SECS = 0.01

T = TypeVar("T")


def new_room() -> int:
    """A random 63-bit bootstrap room, as routers generate them."""
    return random.getrandbits(63)


def with_bootstrap(
    body: dict[str, Any], bootstrap_port: int, room: int | list[int]
) -> dict[str, Any]:
    """``body`` plus the bootstrap fields pointing at a prefill on the loopback host."""
    return dict(body, bootstrap_host=LOOPBACK, bootstrap_port=bootstrap_port, bootstrap_room=room)


async def pd_generate(
    client: httpx.AsyncClient,
    prefill_url: str,
    decode_url: str,
    bootstrap_port: int,
    body: dict[str, Any],
    *,
    path: str = "/generate",
    room: int | list[int] | None = None,
) -> tuple[httpx.Response, httpx.Response]:
    """Send one request to a prefill and a decode at once; returns (prefill, decode) responses."""
    paired = with_bootstrap(body, bootstrap_port, new_room() if room is None else room)
    prefill, decode = await asyncio.gather(
        client.post(prefill_url + path, json=paired), client.post(decode_url + path, json=paired)
    )
    return prefill, decode


async def poll_until(
    probe: Callable[[], Awaitable[T]], what: str, *, deadline_secs: float = POLL_DEADLINE_SECS
) -> T:
    """Await ``probe()`` until it returns something truthy and return that; after
    ``deadline_secs`` (wall clock, however slow each probe is on a loaded machine) raise
    AssertionError naming ``what`` and the last value seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_secs
    while True:
        value = await probe()
        if value:
            return value
        if loop.time() >= deadline:
            raise AssertionError(
                f"timed out after {deadline_secs:g}s waiting for {what}: {value!r}"
            )
        await asyncio.sleep(POLL_INTERVAL_SECS)
