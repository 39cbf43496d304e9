"""Helpers of the conversion tests: live roles of reference workers, a checked client load that
counts every failed request, conversion calls on the router's admin API, and admin calls that
reach the router at the same moment."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11
import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from pd_worker.cluster import WorkerCluster
from pd_worker.tokens import expected_text
from tests.router_helpers import (
    RouterUnderTest,
    generate_body,
    running_router,
    sse_events,
    wait_until,
)


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


# About a second of decoding on a reference worker at the conversion tests' speed (0.05).
LONG = {"text": "a long generation", "sampling_params": {"max_new_tokens": 1200}}


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


async def start_long_request_on_a_decode(
    http: httpx.AsyncClient,
) -> tuple[asyncio.Task[httpx.Response], str]:
    """A generation that keeps one decode busy for about a second; returns (task, decode url)."""
    task = asyncio.create_task(http.post("/generate", json=LONG))
    busy = await wait_for_busy((await pools(http))["decode"])
    return task, busy


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


@contextlib.asynccontextmanager
async def arranged_router(
    cluster: WorkerCluster, prefill: int, **overrides: Any
) -> AsyncIterator[RouterUnderTest]:
    """A router over ``cluster`` in the roles its workers serve now (an earlier test may have
    converted them), converted back to ``prefill`` prefills."""
    prefill_urls, decode_urls = await live_roles(cluster)
    async with running_router(
        cluster, prefill=prefill_urls, decode=decode_urls, **overrides
    ) as router:
        async with router.client() as http:
            await arrange(http, prefill=prefill)
        yield router


async def worker_entry(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    workers = (await http.get("/workers")).json()["workers"]
    return next(w for w in workers if w["url"] == url)


async def conversion_status(http: httpx.AsyncClient, conversion_id: str) -> str:
    return (await http.get(f"/conversions/{conversion_id}")).json()["status"]


async def sample(http: httpx.AsyncClient, name: str, **labels: str) -> float | None:
    """One sample of the router's /metrics, None when the series does not exist."""
    text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


@dataclass(frozen=True)
class Call:
    """One admin call for :func:`send_together`."""

    method: str
    path: str
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any


async def send_together(base_url: str, calls: list[Call]) -> list[Answer]:
    """Send every call on its own connection in one synchronous burst (each connection opened
    and accepted first), so the router reads them all in the same turn of its event loop, in
    this order; then read every answer. This is how two admin calls race inside the router:
    no handler has run yet when the last request arrives."""
    parts = urlsplit(base_url)
    streams = [await asyncio.open_connection(parts.hostname, parts.port) for _ in calls]
    await asyncio.sleep(0.2)  # let the router accept every connection before the burst
    clients = [h11.Connection(h11.CLIENT) for _ in calls]
    for call, client, (_, writer) in zip(calls, clients, streams, strict=True):
        writer.write(_request_bytes(client, call, parts.netloc))
    answers = []
    for client, (reader, writer) in zip(clients, streams, strict=True):
        client.receive_data(await asyncio.wait_for(reader.read(), 60.0))
        client.receive_data(b"")
        writer.close()
        answers.append(_answer(client))
    return answers


def _request_bytes(client: h11.Connection, call: Call, host: str) -> bytes:
    body = orjson.dumps(call.body) if call.body is not None else b""
    headers = [("Host", host), ("Connection", "close"), ("Content-Length", str(len(body)))]
    if call.body is not None:
        headers.append(("Content-Type", "application/json"))
    raw = client.send(h11.Request(method=call.method, target=call.path, headers=headers))
    if body:
        raw += client.send(h11.Data(data=body))
    return raw + client.send(h11.EndOfMessage())


def _answer(client: h11.Connection) -> Answer:
    """The response the router sent on ``client``'s connection (read to its end)."""
    response = client.next_event()
    if not isinstance(response, h11.Response):
        raise AssertionError(f"no HTTP response from the router: {response!r}")
    body = b""
    event = client.next_event()
    while isinstance(event, h11.Data):
        body += event.data
        event = client.next_event()
    return Answer(response.status_code, orjson.loads(body) if body else None)


@contextlib.asynccontextmanager
async def converted_by_a_second_router(
    cluster: WorkerCluster, moved: str, *, within: float, **unaware_overrides: Any
) -> AsyncIterator[tuple[RouterUnderTest, LoadResult]]:
    """An "unaware" router (``unaware_overrides`` on its config) under checked load while a
    second router over the same workers converts ``moved`` to prefill; yields (the unaware
    router, its load's result) once it moved the worker within ``within`` seconds and served
    40 more requests."""
    async with (
        running_router(cluster, **unaware_overrides) as unaware,
        running_router(cluster) as converting,
        converting.client() as admin,
    ):
        worker = unaware.state.registry.get(moved)
        async with CheckedLoad(unaware.url, concurrency=4, tokens=8) as load:
            await load.wait_for_requests(10)
            response = await convert(admin, server_url=moved, new_role="prefill")
            assert response.json()["status"] == "succeeded", response.text
            await wait_until(lambda: worker.role.value == "prefill", within, "unaware moved it")
            await load.wait_for_requests(load.result.ok + load.result.failed + 40)
        yield unaware, load.result
