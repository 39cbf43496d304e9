"""Helpers of the conversion tests: live roles of reference workers, a checked client load that
counts every failed request, and conversion calls on the router's admin API."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pd_worker.cluster import WorkerCluster
from pd_worker.tokens import expected_text
from tests.router_helpers import generate_body, sse_events


async def live_roles(cluster: WorkerCluster) -> tuple[list[str], list[str]]:
    """(prefill urls, decode urls) as the live workers report them (``/pd_role``)."""
    prefill, decode = [], []
    async with httpx.AsyncClient(timeout=5.0) as http:
        for worker in cluster.workers:
            if not worker.alive:
                continue
            role = (await http.get(worker.url + "/pd_role")).json()["role"]
            (prefill if role == "prefill" else decode).append(worker.url)
    return prefill, decode


async def worker_role(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return (await http.get(url + "/pd_role")).json()


async def wait_for_busy(urls: list[str], within: float = 5.0) -> str:
    """The first of ``urls`` that reports a running request (bounded poll)."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=5.0) as http:
        while time.monotonic() < deadline:
            for url in urls:
                if (await http.get(url + "/v1/loads")).json()["aggregate"]["total_running_reqs"]:
                    return url
            await asyncio.sleep(0.01)
    raise AssertionError(f"none of {urls} got busy within {within}s")


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


class CheckedLoad:
    """``concurrency`` clients sending streaming and non-streaming requests until stopped; every
    reply is checked (status, ``[DONE]``, the exact text the decode must produce)."""

    def __init__(
        self,
        base_url: str,
        *,
        concurrency: int = 8,
        tokens: int = 16,
        max_requests: int = 20_000,
        max_secs: float = 60.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.result = LoadResult()
        self._base_url = base_url
        self._concurrency = concurrency
        self._tokens = tokens
        self._max_requests = max_requests
        self._deadline = time.monotonic() + max_secs
        self._headers = headers or {}
        self._stop = asyncio.Event()
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> CheckedLoad:
        self._http = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=30.0,
            headers=self._headers,
            limits=httpx.Limits(max_connections=self._concurrency + 4),
        )
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self._concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.aclose()

    async def wait_for_requests(self, count: int, within: float = 10.0) -> None:
        """Until at least ``count`` requests were answered (bounded)."""
        deadline = time.monotonic() + within
        while self.result.ok + self.result.failed < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"load made only {self.result.ok} requests in {within}s")
            await asyncio.sleep(0.01)

    async def _client(self) -> None:
        while (
            not self._stop.is_set()
            and self.result.sent < self._max_requests
            and time.monotonic() < self._deadline
        ):
            n = next(self._ids)
            self.result.sent += 1
            error = await self._one(f"load prompt {n}", stream=n % 2 == 0)
            if error is None:
                self.result.ok += 1
            else:
                self.result.failed += 1
                self.result.errors.append(error)

    async def _one(self, prompt: str, *, stream: bool) -> str | None:
        body = generate_body(prompt, self._tokens, stream=stream)
        try:
            response = await self._http.post("/generate", json=body)
        except httpx.HTTPError as exc:
            return f"{prompt}: {type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return f"{prompt}: HTTP {response.status_code}: {response.text[:200]}"
        expected = expected_text(prompt, self._tokens)
        if stream:
            events = sse_events(response.text)
            if not events or events[-1] != "[DONE]" or events[-2].get("text") != expected:
                return f"{prompt}: bad stream: {response.text[-200:]}"
            return None
        if response.json().get("text") != expected:
            return f"{prompt}: wrong text {response.text[:200]}"
        return None


async def convert(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await http.post("/convert_pd_role", json=body, timeout=60.0)


async def pools(http: httpx.AsyncClient) -> dict[str, list[str]]:
    """{role: urls of ACTIVE workers} from the router's ``GET /workers``."""
    workers = (await http.get("/workers")).json()["workers"]
    out: dict[str, list[str]] = {"prefill": [], "decode": []}
    for worker in workers:
        if worker["state"] == "active":
            out[worker["role"]].append(worker["url"])
    return out


async def arrange(http: httpx.AsyncClient, prefill: int) -> dict[str, list[str]]:
    """Convert workers through the router until exactly ``prefill`` of them are prefills."""
    current = await pools(http)
    for _ in range(len(current["prefill"]) + len(current["decode"])):
        count = len(current["prefill"])
        if count == prefill:
            return current
        source = "prefill" if count > prefill else "decode"
        response = await convert(http, server_url=current[source][0])
        assert response.status_code == 200, response.text
        current = await pools(http)
    raise AssertionError(f"could not arrange {prefill} prefills: {current}")


async def worker_entry(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    workers = (await http.get("/workers")).json()["workers"]
    return next(w for w in workers if w["url"] == url)


async def conversion_status(http: httpx.AsyncClient, conversion_id: str) -> str:
    return (await http.get(f"/conversions/{conversion_id}")).json()["status"]
