"""An open-loop load for the autopilot's tests: requests sent at a fixed rate whatever their
answers take, as real traffic comes (a fixed number of clients never asks a pool for more than
it serves, so it can never show a pool short of capacity)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from tests.router_helpers import generate_body

# About 200 prompt tokens (a reference worker counts a prompt's bytes).
PROMPT = "a steady mix " * 15 + "of prompts, each two hundred tokens long, and of answers ..."


class OpenLoad:
    """``rate`` requests a second of ``PROMPT`` and ``tokens``-token answers, every other one
    streamed (for ``model`` when given); each status is kept (0: no answer), a stream's once it
    ended."""

    def __init__(self, url: str, rate: float, tokens: int, model: str | None = None) -> None:
        self._url = url
        self._model = {} if model is None else {"model": model}
        self._rate = rate
        self._tokens = tokens
        self.statuses: list[int] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> OpenLoad:
        self._http = httpx.AsyncClient(base_url=self._url, timeout=60.0)
        self._sender = asyncio.create_task(self._send())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._sender
        await asyncio.gather(*self._tasks)
        await self._http.aclose()

    @property
    def failed(self) -> list[int]:
        return [status for status in self.statuses if status != 200]

    async def _send(self) -> None:
        started = time.monotonic()
        for n in range(1_000_000):
            await asyncio.sleep(max(0.0, started + n / self._rate - time.monotonic()))
            task = asyncio.create_task(self._one(n))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, n: int) -> None:
        body = generate_body(f"{n} {PROMPT}", self._tokens, stream=n % 2 == 0, **self._model)
        try:
            async with self._http.stream("POST", "/generate", json=body) as reply:
                await reply.aread()
                self.statuses.append(reply.status_code)
        except httpx.HTTPError:
            self.statuses.append(0)
