"""The router's status page: ``GET /status`` reports the live pools, ``GET /dashboard``
rendered by headless Chromium shows every worker in its pool with its state, in-flight count and
health, and the conversions made through the router, and ``pd-router status --watch`` redraws
the same picture in a terminal."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
import pytest_asyncio
from router_helpers import RouterUnderTest, generate_body, running_router, wait_until

from pd_worker.cluster import WorkerCluster
from tests.model_clusters import (
    BIG,
    SMALL,
    big_and_small,
    models_and_roles,
    regular_entries,
    wait_for_models,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless chromium not installed (Debian: apt-get install chromium; make test does)",
)
RENDER_TIMEOUT_SECS = 60.0
WATCH_TIMEOUT_SECS = 20.0
PD_ROUTER = str(Path(sys.executable).with_name("pd-router"))  # the console script
LONG_REQUEST_TOKENS = 3000  # about 30 s of decode steps at speed 1.0


@dataclass
class Card:
    """One worker card of the rendered page."""

    url: str
    pool: str
    role: str
    state: str
    model: str | None = None  # the model group it is shown in (None: the router serves one)
    text: str = ""
    inflight: str = ""


@dataclass
class RenderedPage(HTMLParser):
    """The worker cards and conversion rows of a DOM dump."""

    cards: dict[str, Card] = field(default_factory=dict)
    conversions: dict[str, str] = field(default_factory=dict)
    live: str = ""
    autopilot: str = ""  # the autopilot's latest decision, as the page words it

    def __post_init__(self) -> None:
        super().__init__()
        self._stack: list[dict[str, str]] = []
        self._pool = ""
        self._model: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self._stack.append({"tag": tag, **a})
        if tag == "div" and "pool" in a.get("class", "").split():
            self._pool = a["data-role"]
            self._model = a.get("data-model")
        if "data-worker-url" in a:
            url = a["data-worker-url"]
            card = Card(url, self._pool, a["data-role"], a["data-state"], self._model)
            self.cards[url] = card

    def handle_endtag(self, tag: str) -> None:
        while self._stack and self._stack.pop()["tag"] != tag:
            pass

    def handle_data(self, data: str) -> None:
        for element in reversed(self._stack):
            if "data-worker-url" in element:
                card = self.cards[element["data-worker-url"]]
                card.text += data + " "
                if self._stack[-1].get("class") == "inflight":
                    card.inflight += data
                break
            if "data-conversion-id" in element:
                key = element["data-conversion-id"]
                self.conversions[key] = self.conversions.get(key, "") + data + " "
                break
        if self._stack and self._stack[-1].get("id") == "live":
            self.live += data
        if self._stack and self._stack[-1].get("id") == "autopilot-last":
            self.autopilot += data


async def render(url: str) -> RenderedPage:
    """The DOM of ``url`` after its scripts ran (headless Chromium, virtual time budget)."""
    with tempfile.TemporaryDirectory(prefix="pd-router-chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=3000",
            "--dump-dom", url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            dom, _ = await asyncio.wait_for(process.communicate(), RENDER_TIMEOUT_SECS)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
    page = RenderedPage()
    page.feed(dom.decode())
    return page


@pytest.fixture(scope="module")
def cluster(module_cluster_factory) -> WorkerCluster:
    """Real-time timing model: a long request stays in flight until the router aborts it."""
    return module_cluster_factory(prefill=2, decode=2, speed=1.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(cluster: WorkerCluster) -> AsyncIterator[RouterUnderTest]:
    async with running_router(cluster) as router:
        yield router


async def status(router: RouterUnderTest) -> dict:
    async with router.client() as http:
        response = await http.get("/status")
    assert response.status_code == 200
    return response.json()


async def test_status_reports_every_worker_with_role_state_inflight_and_health(router, cluster):
    workers = {w["url"]: w for w in (await status(router))["workers"]}
    assert set(workers) == set(cluster.urls)
    for url in cluster.prefill_urls:
        assert workers[url]["role"] == "prefill"
        assert workers[url]["bootstrap_port"] == cluster.bootstrap_port(url)
    for url in cluster.decode_urls:
        assert workers[url]["role"] == "decode"
    for worker in workers.values():
        assert worker["state"] == "active"
        assert worker["healthy"] is True
        assert worker["inflight"] == 0
        assert worker["circuit"] == "closed"


async def test_status_counts_active_healthy_and_selectable_workers_per_pool(router, cluster):
    pools = (await status(router))["pools"]
    for role, urls in (("prefill", cluster.prefill_urls), ("decode", cluster.decode_urls)):
        assert pools[role]["active"] == pools[role]["healthy"] == pools[role]["selectable"] == 2
        assert len(pools[role]["workers"]) == len(urls)


async def test_status_lists_no_conversions_before_any_and_says_the_manager_is_there(router):
    body = await status(router)
    assert body["conversions"] == []
    assert body["conversions_available"] is True
    assert body["admin_key_required"] is False


async def test_dashboard_page_loads_nothing_from_elsewhere(router):
    async with router.client() as http:
        response = await http.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    html = response.text
    assert not re.search(r"\bsrc\s*=", html)
    assert not re.search(r"""href\s*=\s*["'](https?:)?//""", html)
    assert "@import" not in html
    assert "url(" not in html


@needs_chromium
async def test_page_in_chromium_shows_every_live_worker_in_its_pool(router, cluster):
    page = await render(router.url + "/dashboard")
    assert page.live.startswith("live"), page.live
    assert set(page.cards) == set(cluster.urls)
    for url in cluster.prefill_urls:
        assert (page.cards[url].pool, page.cards[url].role) == ("prefill", "prefill")
    for url in cluster.decode_urls:
        assert (page.cards[url].pool, page.cards[url].role) == ("decode", "decode")
    for card in page.cards.values():
        assert card.state == "active"
        assert "healthy" in card.text.split()
        assert card.inflight == "0"
        assert card.model is None and "model" not in card.text.split()


@needs_chromium
async def test_page_in_chromium_offers_no_convert_button_for_a_conversion_that_would_be_refused(
    cluster,
):
    last_prefill = cluster.prefill_urls[0]
    async with running_router(prefill=[last_prefill], decode=cluster.decode_urls) as router:
        page = await render(router.url + "/dashboard")
    assert "Convert to" not in page.cards[last_prefill].text
    assert "no conversion" in page.cards[last_prefill].text
    for url in cluster.decode_urls:
        assert "Convert to prefill" in page.cards[url].text


async def test_redacted_status_says_which_conversions_the_router_would_refuse(cluster):
    last_prefill = cluster.prefill_urls[0]
    async with (
        running_router(
            prefill=[last_prefill], decode=cluster.decode_urls, admin_api_key="s3cret"
        ) as router,
        router.client() as http,
    ):
        body = (await http.get("/status")).json()
    assert body["redacted"] is True
    refused = {worker["url"]: worker["convert_refused"] for worker in body["workers"]}
    assert "minimum" in refused[last_prefill]
    assert all(refused[url] is None for url in cluster.decode_urls)


@needs_chromium
async def test_redacted_page_in_chromium_offers_no_convert_button_for_the_last_prefill(cluster):
    last_prefill = cluster.prefill_urls[0]
    async with running_router(
        prefill=[last_prefill], decode=cluster.decode_urls, admin_api_key="s3cret"
    ) as router:
        page = await render(router.url + "/dashboard")
    assert "Convert to" not in page.cards[last_prefill].text
    assert "no conversion" in page.cards[last_prefill].text


@needs_chromium
async def test_page_in_chromium_shows_an_unreachable_worker_first_in_its_pool_as_unhealthy(
    cluster, free_port
):
    mistyped = f"http://127.0.0.1:{free_port()}"
    decode = [*cluster.decode_urls, mistyped]
    async with running_router(cluster, decode=decode) as router:
        page = await render(router.url + "/dashboard")
    decode_cards = [card for card in page.cards.values() if card.pool == "decode"]
    assert decode_cards[0].url == mistyped
    words = decode_cards[0].text.split()
    assert words[2] == "unhealthy", words
    assert "active" not in words
    for card in decode_cards[1:]:
        assert card.text.split()[2] == "active"


@needs_chromium
async def test_page_in_chromium_shows_requests_in_flight_on_each_worker(router, cluster):
    long = generate_body("held", tokens=LONG_REQUEST_TOKENS)
    async with router.client() as http:
        held = [asyncio.create_task(http.post("/generate", json=long)) for _ in range(3)]
        try:

            async def all_in_flight() -> bool:
                workers = (await status(router))["workers"]
                return sum(w["inflight"] for w in workers if w["role"] == "decode") == len(held)

            await wait_until(all_in_flight, 10.0, "3 requests in flight on the decodes")
            expected = {w["url"]: str(w["inflight"]) for w in (await status(router))["workers"]}
            page = await render(router.url + "/dashboard")
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
    assert {url: card.inflight for url, card in page.cards.items()} == expected
    assert any(value != "0" for value in expected.values())


@needs_chromium
async def test_page_in_chromium_shows_a_conversion_and_the_worker_in_its_new_pool(router, cluster):
    moved = cluster.prefill_urls[1]
    async with router.client() as http:

        async def idle() -> bool:
            return all(w["inflight"] == 0 for w in (await status(router))["workers"])

        await wait_until(idle, 10.0, what="no request in flight")
        response = await http.post(
            "/convert_pd_role", json={"server_url": moved, "new_role": "decode"}
        )
        assert response.status_code == 200, response.text
        conversion_id = response.json()["id"]
        try:
            page = await render(router.url + "/dashboard")
        finally:
            back = await http.post(
                "/convert_pd_role", json={"server_url": moved, "new_role": "prefill"}
            )
            assert back.status_code == 200, back.text
    card = page.cards[moved]
    assert (card.pool, card.role, card.state) == ("decode", "decode", "active")
    row = page.conversions[conversion_id]
    assert moved in row
    assert "prefill → decode" in row
    assert "succeeded" in row.split()


@needs_chromium
async def test_page_in_chromium_shows_a_worker_draining_while_its_conversion_waits(router):
    long = generate_body("keeps the decode busy", tokens=LONG_REQUEST_TOKENS)
    async with router.client() as http:
        held = asyncio.create_task(http.post("/generate", json=long))
        try:

            async def busy_decode() -> str | None:
                workers = (await status(router))["workers"]
                return next(
                    (w["url"] for w in workers if w["role"] == "decode" and w["inflight"]), None
                )

            await wait_until(busy_decode, 10.0, "the request in flight on a decode")
            url = await busy_decode()
            started = await http.post(
                "/convert_pd_role", json={"server_url": url, "new_role": "prefill", "wait": False}
            )
            assert started.status_code == 202, started.text
            conversion_id = started.json()["id"]
            try:
                page = await render(router.url + "/dashboard")
            finally:
                aborted = await http.delete(f"/conversions/{conversion_id}")
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
    assert aborted.status_code in (200, 202)
    card = page.cards[url]
    assert (card.pool, card.state) == ("decode", "draining")
    assert "draining" in page.conversions[conversion_id].split()


async def test_status_answers_redacted_without_the_admin_key_when_one_is_set(cluster):
    async with (
        running_router(cluster, admin_api_key="s3cret") as router,
        router.client() as http,
    ):
        page = await http.get("/dashboard")
        body = (await http.get("/status")).json()
        refused = await http.post("/convert_pd_role", json={"server_url": cluster.urls[0]})
    assert page.status_code == 200
    assert body["admin_key_required"] is True
    assert body["redacted"] is True
    assert refused.status_code == 401


async def watch_frames(router_url: str, frames: int) -> tuple[list[str], int | None]:
    """Run ``pd-router status --watch`` until it drew ``frames`` pictures, then Ctrl-C it."""
    process = await asyncio.create_subprocess_exec(
        PD_ROUTER, "status", "--router", router_url,
        "--watch", "0.1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    output = ""
    try:
        async with asyncio.timeout(WATCH_TIMEOUT_SECS):
            while output.count(f"pd-router {router_url}") <= frames:
                chunk = await process.stdout.read(4096)
                if not chunk:
                    break
                output += chunk.decode()
        process.send_signal(signal.SIGINT)
        await asyncio.wait_for(process.wait(), WATCH_TIMEOUT_SECS)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    pictures = output.split(f"pd-router {router_url}")[1 : frames + 1]
    return pictures, process.returncode


async def test_status_watch_redraws_the_pools_and_workers_until_interrupted(router, cluster):
    pictures, returncode = await watch_frames(router.url, 2)
    assert len(pictures) == 2
    for picture in pictures:
        assert "Pools" in picture
        for url in cluster.urls:
            assert url in picture
    assert returncode == 0


async def test_status_watch_keeps_going_while_the_router_is_unreachable(free_port):
    url = f"http://127.0.0.1:{free_port()}"
    pictures, returncode = await watch_frames(url, 2)
    assert len(pictures) == 2
    assert all("router not reachable" in picture for picture in pictures)
    assert returncode == 0


@pytest.fixture(scope="module")
def models(module_cluster_factory) -> tuple[WorkerCluster, WorkerCluster]:
    return big_and_small(module_cluster_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two_models(models) -> AsyncIterator[RouterUnderTest]:
    """One router over ``big`` (PD) and ``small`` (regular workers), its autopilot
    recommending (it converts nothing)."""
    big, small = models
    autopilot = {"mode": "recommend", "interval_secs": 0.05, "window_secs": 0.05}
    async with running_router(big, regular=regular_entries(small), autopilot=autopilot) as router:
        await wait_for_models(router)
        yield router


async def test_status_of_one_model_has_no_per_model_pools(router):
    assert "models" not in await status(router)


async def test_status_counts_each_models_pools_when_several_are_served(two_models):
    body = await status(two_models)
    counts = {
        model: {role: (pool["active"], len(pool["workers"])) for role, pool in pools.items()}
        for model, pools in body["models"].items()
    }
    assert counts == {BIG: {"prefill": (1, 1), "decode": (2, 2)}, SMALL: {"regular": (2, 2)}}
    assert {role: pool["active"] for role, pool in body["pools"].items()} == {
        "prefill": 1,
        "decode": 2,
        "regular": 2,
    }


@needs_chromium
async def test_page_in_chromium_groups_the_pools_by_model_and_names_each_cards_model(
    two_models, models
):
    page = await render(two_models.url + "/dashboard")
    assert page.live.startswith("live"), page.live
    shown = {url: (card.model, card.role) for url, card in page.cards.items()}
    assert shown == models_and_roles(*models)
    assert all(card.pool == card.role for card in page.cards.values())
    for url, card in page.cards.items():
        assert f"model {card.model}" in " ".join(card.text.split()), url


@needs_chromium
async def test_page_in_chromium_offers_no_conversion_of_a_regular_worker(two_models, models):
    page = await render(two_models.url + "/dashboard")
    for url, (_, role) in models_and_roles(*models).items():
        if role == "regular":
            assert "Convert" not in page.cards[url].text
            assert "no conversion" not in page.cards[url].text
        elif role == "decode":
            assert "Convert to prefill" in page.cards[url].text


@needs_chromium
async def test_page_in_chromium_names_the_model_of_the_autopilots_latest_decision(two_models):
    async def decided() -> bool:
        return (await status(two_models))["autopilot"]["last_decision"] is not None

    await wait_until(decided, RENDER_TIMEOUT_SECS, "an autopilot decision")
    assert (await status(two_models))["autopilot"]["last_decision"]["model"] == BIG
    page = await render(two_models.url + "/dashboard")
    assert page.autopilot.startswith(f"latest: {BIG}: "), page.autopilot
