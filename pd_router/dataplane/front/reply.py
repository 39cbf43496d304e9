"""The answer to one request, written on its connection: whole (:meth:`Reply.send`) or
streamed (:meth:`Reply.start`, :meth:`Reply.write`, :meth:`Reply.end`).

A stream is sent chunked to an HTTP/1.1 client and delimited by closing the connection for an
HTTP/1.0 one. A write to a client that went away raises ``ConnectionResetError``, as aiohttp's
does, so the request path tells an abort from a worker's failure the same way.
"""

from __future__ import annotations

import http
import time
from collections.abc import Iterable
from email.utils import formatdate
from typing import Protocol

import orjson

from pd_router.dataplane.front.request import ClientRequest

Headers = Iterable[tuple[str, str]]

STATUS_LINES = {
    status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n" for status in http.HTTPStatus
}
# Answers that never have a body (RFC 9110 6.4.1).
NO_BODY = frozenset({204, 304})


class Writer(Protocol):
    """What a reply needs of its connection."""

    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...


class HttpDate:
    """The ``Date`` header's value, formatted at most once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = ""

    def now(self) -> str:
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._value = formatdate(second, usegmt=True)
        return self._value


DATE = HttpDate()


class Answer(Protocol):
    """What the request path writes one answer on: a :class:`Reply` to the client, or one
    sample's share of a fanned-out request (:mod:`pd_router.dataplane.path.fanout`)."""

    status: int
    delivered: int | None

    async def send(
        self, status: int, body: bytes, content_type: str | None, headers: Headers = ()
    ) -> None: ...
    async def start(
        self, status: int, headers: Headers, length: int | None = None, *, own: bool = True
    ) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end(self) -> None: ...


def sse_error_event(message: str, error_type: str, status: int) -> bytes:
    """The event that ends a stream broken after its first byte, in SGLang's error shape."""
    error = {"error": {"message": message, "type": error_type, "code": status}}
    return b"data: " + orjson.dumps(error) + b"\n\n"


def status_line(status: int) -> str:
    return STATUS_LINES.get(status) or f"HTTP/1.1 {status} Status {status}\r\n"


class Reply:
    """One request's answer. ``common`` headers go on every answer the router makes itself (the
    request id, CORS); a relayed answer brings its own. ``delivered`` is the status of an answer
    whose end reached the client: a client that leaves after it is not an abort. ``finished``:
    the answer is complete on the wire, so the connection may carry the next one."""

    __slots__ = (
        "_chunked",
        "_head_only",
        "_http11",
        "_writer",
        "common",
        "delivered",
        "finished",
        "keep_alive",
        "started",
        "status",
    )

    def __init__(self, writer: Writer, request: ClientRequest) -> None:
        self._writer = writer
        self._head_only = request.method == "HEAD"
        self._chunked = False
        self._http11 = request.version != "1.0"
        self.keep_alive = request.keep_alive and self._http11
        self.common: list[tuple[str, str]] = []
        self.started = False
        self.status = 0
        self.delivered: int | None = None
        self.finished = False

    def _head(self, status: int, headers: Headers, framing: str) -> bytes:
        lines = [status_line(status)]
        lines.extend(f"{name}: {value}\r\n" for name, value in headers)
        lines.append(framing)
        lines.append(
            "Connection: keep-alive\r\n\r\n" if self.keep_alive else "Connection: close\r\n\r\n"
        )
        return "".join(lines).encode("latin-1")

    async def send(
        self, status: int, body: bytes, content_type: str | None, headers: Headers = ()
    ) -> None:
        """The whole answer, with the common headers."""
        own = [("Date", DATE.now())]
        if content_type:
            own.append(("Content-Type", content_type))
        own.extend(headers)
        own.extend(self.common)
        self.started = True
        self.status = status
        if status in NO_BODY:
            self._writer.write(self._head(status, own, ""))
        else:
            framing = f"Content-Length: {len(body)}\r\n"
            self._writer.write(
                self._head(status, own, framing) + (b"" if self._head_only else body)
            )
        self.delivered = status
        self.finished = True
        await self._writer.drain()

    async def start(
        self,
        status: int,
        headers: Headers,
        length: int | None = None,
        *,
        own: bool = True,
    ) -> None:
        """The head of an answer whose body follows in :meth:`write` calls: ``length`` bytes of
        it, or chunked when unknown. ``own``: the router's answer (Date and the common headers
        added); else a relayed one, sent with the headers it came with."""
        if own:
            headers = [("Date", DATE.now()), *headers, *self.common]
        self.started = True
        self.status = status
        if status in NO_BODY or self._head_only:
            framing = "" if length is None else f"Content-Length: {length}\r\n"
        elif length is not None:
            framing = f"Content-Length: {length}\r\n"
        elif self._http11:
            framing = "Transfer-Encoding: chunked\r\n"
            self._chunked = True
        else:
            framing = ""
        self._writer.write(self._head(status, headers, framing))
        await self._writer.drain()

    async def write(self, data: bytes) -> None:
        if not data or self._head_only:
            return
        if self._chunked:
            self._writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._writer.write(data)
        await self._writer.drain()

    async def end(self) -> None:
        """The end of a streamed answer."""
        if self._chunked and not self._head_only:
            self._writer.write(b"0\r\n\r\n")
        self.delivered = self.status
        self.finished = True
        await self._writer.drain()
