"""One call from the router to a worker over the router's shared session (its worker key and
TLS context included), and the same call to many at once. A call never raises: a worker that
cannot be reached gives a :class:`CallReply` without a status, so a fan-out reports every worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from pd_router.control.workers import Worker

FAN_OUT_TIMEOUT = aiohttp.ClientTimeout(total=30.0)


@dataclass(slots=True)
class CallReply:
    worker: Worker
    status: int | None
    body: bytes
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def summary(self) -> dict:
        entry: dict = {
            "url": self.worker.url,
            "role": self.worker.role.value,
            "status": self.status,
        }
        if self.error is not None:
            entry["error"] = self.error
        elif not self.ok:
            entry["message"] = self.body[:500].decode("utf-8", "replace")
        return entry


async def call(
    session: aiohttp.ClientSession,
    worker: Worker,
    method: str,
    path: str,
    *,
    data: bytes | None = None,
    params: dict[str, str] | None = None,
    limit: aiohttp.ClientTimeout = FAN_OUT_TIMEOUT,
) -> CallReply:
    headers = {"Content-Type": "application/json"} if data is not None else None
    try:
        async with session.request(
            method, worker.url + path, data=data, params=params, headers=headers, timeout=limit
        ) as resp:
            return CallReply(worker, resp.status, await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        return CallReply(worker, None, b"", f"{type(exc).__name__}: {exc}")


async def fan_out(
    session: aiohttp.ClientSession, workers: list[Worker], method: str, path: str, **kwargs
) -> list[CallReply]:
    return list(await asyncio.gather(*(call(session, w, method, path, **kwargs) for w in workers)))
