"""Conversions of real SGLang 0.5.23 servers under load, through all three ways an operator asks
for one (``pd-router convert``, ``POST /convert_pd_role``, mini_lb's ``POST /pd_role_switch``):
no request fails, every answer is token for token the colocated server's, and each conversion's
verify step read the new role from SGLang itself.

The twelve conversions walk every server through both roles and back to where it started; the
tenth takes a prefill around a second round trip (P -> D -> P) while decodes that talked to it
never switched, which meets SGLang 0.5.23's stale-endpoint bug (docs/sglang-bugs.md): the
patched decode forgets the old endpoint when the router asks, the plain one cannot, and the
canary and the rendezvous wait keep clients off that pair. The last two take that plain decode
around a round trip of its own, the one thing that clears what it cached, so the fleet is clean
for the tests after this one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.cli_process import PD_ROUTER, Served, run, serving
from tests.sglang_cluster import Fleet, SGLangServer, eventually, router_ready

pytestmark = pytest.mark.real_sglang

TIMEOUT = 180.0
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]
GREEDY = {"temperature": 0, "max_new_tokens": 12}
CLIENTS = 3
RENDEZVOUS_SECS = 10.0


@pytest.fixture(scope="module")
def router(sglang_fleet: Fleet) -> Iterator[Served]:
    args = [*sglang_fleet.router_args(), "--host", "127.0.0.1"]
    args += ["--health-check-interval-secs", "1"]
    args += ["--rendezvous-timeout-secs", str(RENDEZVOUS_SECS)]
    with serving(*args) as served:
        router_ready(served.url, prefill=2, decode=2)
        yield served


@dataclass
class Load:
    """Clients sending greedy /generate requests until stopped; every answer is checked against
    the colocated server's tokens for the same prompt."""

    url: str
    expected: dict[str, list[int]]
    stop: threading.Event = field(default_factory=threading.Event)
    answered: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # What the test is doing, named in each failure (the conversion in progress).
    during: str = "before the first conversion"

    def client(self, index: int) -> None:
        with httpx.Client(timeout=TIMEOUT) as http:
            n = index
            while not self.stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                body = {"text": prompt, "sampling_params": GREEDY, "stream": n % 2 == 0}
                try:
                    reply = http.post(self.url + "/generate", json=body)
                    outcome = check(reply, self.expected[prompt], streamed=body["stream"])
                except httpx.HTTPError as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                with self.lock:
                    if outcome:
                        self.failures.append(f"{self.during}: {outcome}")
                    else:
                        self.answered += 1

    def __enter__(self) -> Load:
        self.threads = [
            threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(CLIENTS)
        ]
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(TIMEOUT)


def check(reply: httpx.Response, expected: list[int], *, streamed: bool) -> str | None:
    """Why this answer is wrong, or None."""
    if reply.status_code != 200:
        return f"{reply.status_code}: {reply.text[:300]}"
    if streamed:
        chunks = [c for c in reply.text.split("\n\n") if c.startswith("data: {")]
        if not chunks or not reply.text.rstrip().endswith("data: [DONE]"):
            return f"stream cut: {reply.text[-300:]}"
        last = httpx.Response(200, content=chunks[-1][len("data: ") :]).json()
    else:
        last = reply.json()
    if "error" in last:
        return f"error event: {last['error']}"
    if last["output_ids"] != expected:
        return f"tokens {last['output_ids']} != colocated {expected}"
    return None


def convert(router: Served, how: str, server: SGLangServer, to: str) -> dict[str, Any]:
    """One conversion through ``how`` (cli, convert_pd_role, pd_role_switch); the router's
    record of it."""
    if how == "cli":
        result = run(PD_ROUTER, "convert", server.url, "--to", to, "--router", router.url,
                     timeout=TIMEOUT)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
    elif how == "convert_pd_role":
        body = {"server_url": server.url, "new_role": to}
        reply = httpx.post(router.url + "/convert_pd_role", json=body, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
    else:
        body = {"worker_url": server.url, "new_role": to}
        reply = httpx.post(router.url + "/pd_role_switch", json=body, timeout=TIMEOUT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["success"], reply.text
    records = httpx.get(router.url + "/conversions", timeout=10).json()["conversions"]
    return next(r for r in records if r["worker_url"] == server.url)


def test_twelve_conversions_under_load_fail_no_request(sglang_fleet: Fleet, router: Served) -> None:
    fleet = sglang_fleet
    p0, p1 = fleet.prefill
    d0, d1 = fleet.decode
    expected = {
        prompt: httpx.post(
            fleet.reference.url + "/generate",
            json={"text": prompt, "sampling_params": GREEDY},
            timeout=TIMEOUT,
        ).json()["output_ids"]
        for prompt in PROMPTS
    }
    plan = [
        (p1, "decode"), (d0, "prefill"), (p0, "decode"), (d1, "prefill"), (p1, "prefill"),
        (d0, "decode"), (p0, "prefill"), (d1, "decode"), (p1, "decode"), (p1, "prefill"),
        (d0, "prefill"), (d0, "decode"),
    ]  # fmt: skip
    ways = ["cli", "convert_pd_role", "pd_role_switch"]
    with Load(router.url, expected) as load:
        for step, (server, to) in enumerate(plan):
            load.during = f"step {step}, {server.name} to {to}"
            before = load.answered
            record = convert(router, ways[step % len(ways)], server, to)
            assert record["status"] == "succeeded", record
            assert [p["name"] for p in record["phases"]][-2:] == ["switch", "verify"], record
            assert server.role() == to, (step, server.name)
            assert load.answered > before or step == 0 or load.failures, "no traffic flowed"
        answered_at_end = load.answered
        load.during = "after the last conversion"
        router_ready(router.url, prefill=2, decode=2)
        # Traffic after the last conversion, through every pair.
        while load.answered < answered_at_end + 3 * CLIENTS and not load.failures:
            load.stop.wait(0.2)
    legs = [line for line in router.log().splitlines() if "leg failed" in line or "forg" in line]
    workers = {s.url: s.name for s in fleet.pd}
    assert load.failures == [], (load.failures[:5], workers, legs[-20:])
    assert load.answered > 30
    assert [s.role() for s in fleet.pd] == ["prefill", "prefill", "decode", "decode"]


def test_a_stale_pair_costs_a_request_at_most_the_rendezvous_wait(
    sglang_fleet: Fleet, router: Served
) -> None:
    """SGLang 0.5.23's bug b through the router: p0 goes around a round trip by SGLang's own
    switch (no server_patch on p0 or d0), which the router may not see, so d0 and d1 keep p0's
    old endpoint. A request through a stale pair ends at the rendezvous wait and is answered by
    another pair; the patched d1 is then told to forget p0, the plain d0 cannot be, and its pair
    is rested. Converting d0 there and back clears it (a decode's own switch drops what it
    cached), which also leaves the shared fleet clean."""
    p0, d0 = sglang_fleet.prefill[0], sglang_fleet.decode[0]
    for _ in range(4):  # d0 learns p0's endpoint
        body = {"text": PROMPTS[0], "sampling_params": GREEDY}
        assert httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT).status_code == 200
    for role in ("decode", "prefill"):
        assert p0.switch(role)["success"]
    router_ready(router.url, prefill=2, decode=2)
    latencies = []
    for i in range(8):
        started = time.monotonic()
        body = {"text": f"{i} {PROMPTS[1]}", "sampling_params": GREEDY}
        reply = httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT)
        latencies.append(time.monotonic() - started)
        assert reply.status_code == 200, reply.text
    assert max(latencies) < RENDEZVOUS_SECS + 10, latencies
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'kind="rendezvous"' in metrics
    for role in ("prefill", "decode"):
        record = convert(router, "convert_pd_role", d0, role)
        assert record["status"] == "succeeded", record
        assert record["timings"]["drain_s"] < RENDEZVOUS_SECS + 5, record
    # d1 costs one more wait if none of the requests before took the pair (p0, d1), and
    # forgets p0 after it; then no pair is stale.
    misses = rendezvous_misses(router)
    send_after(router, "once", 6)
    assert rendezvous_misses(router) - misses <= 1
    if rendezvous_misses(router) > misses:
        d1 = sglang_fleet.decode[1]
        forgot = f"decode {d1.url} forgot the endpoints of prefill {p0.url}"
        eventually(lambda: forgot in router.log(), 10, forgot)
    started = time.monotonic()
    send_after(router, "clean", 6)
    assert time.monotonic() - started < RENDEZVOUS_SECS


def send_after(router: Served, what: str, count: int) -> None:
    for i in range(count):
        body = {"text": f"after {what} {i}", "sampling_params": GREEDY}
        assert httpx.post(router.url + "/generate", json=body, timeout=TIMEOUT).status_code == 200


def rendezvous_misses(router: Served) -> float:
    """The router's rendezvous misses so far, both roles."""
    lines = httpx.get(router.url + "/metrics", timeout=10).text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("pd_router_upstream_errors_total{") and 'kind="rendezvous"' in line
    )
