"""The status page's convert button, driven in headless Chromium over the DevTools protocol:
it converts the worker through the router's ``POST /convert_pd_role``, asking for the admin
key when the router answers 401, and shows the refusal when no key is given."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from router_helpers import RouterUnderTest, running_router, wait_until

from pd_worker.cluster import WorkerCluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="headless chromium not installed (Debian: apt-get install chromium; make test does)",
    ),
]

ADMIN_KEY = "dashboard-test-key"
STEP_TIMEOUT_SECS = 20.0
DEVTOOLS_PREFIX = "DevTools listening on "


class DevTools:
    """A minimal DevTools protocol client for one page: commands and events."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.dialogs: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            data = json.loads(message.data)
            if "id" in data:
                self._replies.pop(data["id"]).set_result(data)
            elif data.get("method") == "Page.javascriptDialogOpening":
                await self.dialogs.put(data["params"])

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        command_id = next(self._ids)
        reply = asyncio.get_running_loop().create_future()
        self._replies[command_id] = reply
        await self._ws.send_str(json.dumps({"id": command_id, "method": method, "params": params}))
        data = await asyncio.wait_for(reply, STEP_TIMEOUT_SECS)
        if "error" in data:
            raise AssertionError(f"{method}: {data['error']}")
        return data["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def browser_page(url: str) -> AsyncIterator[DevTools]:
    """Headless Chromium with ``url`` open, driven over its DevTools websocket."""
    with tempfile.TemporaryDirectory(prefix="pd-router-chromium-") as profile:
        process = await asyncio.create_subprocess_exec(
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0", "about:blank",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            endpoint = await asyncio.wait_for(devtools_endpoint(process), STEP_TIMEOUT_SECS)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://{endpoint}/json/list") as response:
                    targets = await response.json()
                (page,) = [t for t in targets if t["type"] == "page"]
                async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    devtools = DevTools(ws)
                    try:
                        await devtools.send("Page.enable")
                        await devtools.send("Page.navigate", url=url)
                        yield devtools
                    finally:
                        await devtools.close()
        finally:
            process.kill()
            await process.wait()


async def devtools_endpoint(process: asyncio.subprocess.Process) -> str:
    """``host:port`` of the DevTools server, from the line Chromium prints on start-up."""
    while line := await process.stderr.readline():
        text = line.decode(errors="replace").strip()
        if text.startswith(DEVTOOLS_PREFIX):
            return text[len(DEVTOOLS_PREFIX) :].split("/")[2]
    raise AssertionError("chromium exited without opening its DevTools port")


@pytest.fixture(scope="module")
def cluster(module_cluster_factory) -> WorkerCluster:
    return module_cluster_factory(prefill=2, decode=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def router(cluster: WorkerCluster) -> AsyncIterator[RouterUnderTest]:
    async with running_router(cluster, admin_api_key=ADMIN_KEY) as router:
        yield router


async def worker_role(router: RouterUnderTest, url: str) -> str:
    async with router.client() as http:
        workers = (await http.get("/status")).json()["workers"]
    return next(w["role"] for w in workers if w["url"] == url)


async def click_convert(page: DevTools, url: str) -> None:
    """Wait until the page shows ``url``'s card with an enabled button, then click it."""
    button = f"document.querySelector('[data-worker-url=\"{url}\"] button.convert')"

    async def ready() -> bool:
        return bool(await page.evaluate(f"!!{button} && !{button}.disabled"))

    await wait_until(ready, STEP_TIMEOUT_SECS, f"convert button of {url}")
    await page.evaluate(f"{button}.click()")


async def test_convert_button_asks_for_the_admin_key_and_converts_the_worker(router, cluster):
    url = cluster.prefill_urls[1]
    async with browser_page(router.url + "/dashboard") as page:
        await click_convert(page, url)
        dialog = await asyncio.wait_for(page.dialogs.get(), STEP_TIMEOUT_SECS)
        assert dialog["type"] == "prompt"
        await page.send("Page.handleJavaScriptDialog", accept=True, promptText=ADMIN_KEY)

        async def converted() -> bool:
            return await worker_role(router, url) == "decode"

        await wait_until(converted, STEP_TIMEOUT_SECS, f"{url} converted to decode")

        async def shown_in_decode_pool() -> bool:
            card = f'.pool[data-role="decode"] [data-worker-url="{url}"]'
            return bool(await page.evaluate(f"!!document.querySelector('{card}')"))

        await wait_until(shown_in_decode_pool, STEP_TIMEOUT_SECS, "card moved to decode pool")


async def test_convert_button_without_a_key_shows_the_refusal_and_changes_nothing(router, cluster):
    # A worker the router would convert: after the test above, the first prefill is the last
    # one, and the page (rightly) offers no button for it.
    roles = {u: await worker_role(router, u) for u in cluster.urls}
    url = next(u for u in cluster.urls if list(roles.values()).count(roles[u]) > 1)
    before = roles[url]
    async with browser_page(router.url + "/dashboard") as page:
        await click_convert(page, url)
        await asyncio.wait_for(page.dialogs.get(), STEP_TIMEOUT_SECS)
        await page.send("Page.handleJavaScriptDialog", accept=False)

        async def refusal_shown() -> bool:
            text = await page.evaluate("document.getElementById('banner').textContent")
            return "admin API key required" in text

        await wait_until(refusal_shown, STEP_TIMEOUT_SECS, "the 401 message in the banner")
    assert await worker_role(router, url) == before
