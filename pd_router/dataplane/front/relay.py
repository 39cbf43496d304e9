"""Every request but a generation one goes, as it came (method, target, headers, body), to the
router's aiohttp application on a Unix socket, and its answer back to the client as it streams.

The application is the one process's own in a one-process router and the control process's in
a data plane, so the admin API, ``/workers``, ``/status``, ``/dashboard``, ``/metrics``,
``/conversions``, the autopilot and every info route show the whole router whichever process
accepted the connection. The application checks the admin key and counts the request in its
metrics, as for any request. A client that goes away closes the relayed request, which cancels
its handler.
"""

from __future__ import annotations

from collections.abc import Iterable

import aiohttp

from pd_router.dataplane.front.reply import Reply
from pd_router.dataplane.front.request import ClientRequest
from pd_router.errors import UpstreamUnavailable

# Headers that describe one connection, not the message (RFC 9110 7.6.1), and the ones the
# relay sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "expect",
    }
)
# Headers aiohttp's client would add to a request that lacks them.
NOT_ADDED = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


def end_to_end(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(name, value) for name, value in headers if name.lower() not in HOP_BY_HOP]


class Relay:
    """Relays requests to the application listening at ``socket_path``."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self.socket_path),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, request: ClientRequest, reply: Reply) -> None:
        if self._session is None:
            raise RuntimeError("relay not started")
        headers = end_to_end(
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in request.raw_headers
        )
        try:
            async with self._session.request(
                request.method,
                "http://router" + request.target.decode("latin-1"),
                headers=headers,
                data=bytes(request.body) if request.body else None,
                allow_redirects=False,
                skip_auto_headers=NOT_ADDED,
            ) as answer:
                await reply.start(
                    answer.status,
                    end_to_end(answer.headers.items()),
                    answer.content_length,
                    own=False,
                )
                async for chunk in answer.content.iter_any():
                    await reply.write(chunk)
                await reply.end()
        except aiohttp.ClientError as exc:
            if reply.started:
                raise ConnectionResetError(f"the router's application broke off: {exc}") from None
            raise UpstreamUnavailable(
                f"the router's control process did not answer: {exc}"
            ) from None
