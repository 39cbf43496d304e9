"""A data plane's answer to every path but the generation endpoints: the control process's.

The admin API, ``/workers``, ``/status``, ``/dashboard``, ``/metrics``, ``/conversions``, the
autopilot and every info route show the whole router, so a data plane passes such a request,
as it came (method, path, query, headers, body), to the control process's HTTP server on a
Unix socket and relays the answer, streamed. The control process checks the admin key and
counts the request in its metrics, as for a request it accepted itself.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

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
    }
)


def end_to_end(headers: CIMultiDict[str] | aiohttp.typedefs.LooseHeaders) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


# Set on a request a data plane passes on: the control process counts it, not the data plane.
FORWARDED = web.RequestKey("forwarded", bool)


class ControlForwarder:
    """Relays requests to the control process's server at ``socket_path``."""

    def __init__(self, socket_path: str) -> None:
        self._socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=self._socket_path),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._session is None:
            raise RuntimeError("forwarder not started")
        request[FORWARDED] = True
        body = await request.read() if request.body_exists else None
        try:
            async with self._session.request(
                request.method,
                "http://control" + request.rel_url.raw_path_qs,
                headers=end_to_end(request.headers),
                data=body,
                allow_redirects=False,
            ) as answer:
                response = web.StreamResponse(
                    status=answer.status, reason=answer.reason, headers=end_to_end(answer.headers)
                )
                if answer.content_length is not None:
                    response.content_length = answer.content_length
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(
                f"the router's control process did not answer: {exc}"
            ) from None
