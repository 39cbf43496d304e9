"""Helpers for tests that talk to reference workers directly (without a router).

:func:`pd_generate` does what a PD router does for one request: add the prefill's bootstrap
address and a fresh room to the body and send it to the prefill and the decode at once.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

LOOPBACK = "127.0.0.1"


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
