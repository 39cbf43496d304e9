"""Request ids: the client's, when it sent a sane one, or fresh ones."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

MAX_REQUEST_ID_LENGTH = 128


class RequestIds:
    """Request ids: the client's, read from the first of ``client_headers`` it sent, or fresh
    ones: 96 random bits from the operating system's CSPRNG, as 24 hex digits.

    A router-made id is also the ``rid`` workers know the request by, and a rid is all
    ``/abort_request`` needs, so an id must not be guessable from the ids a client has seen
    (``X-Request-Id``). The random bytes are drawn in blocks, one ``os.urandom`` call per
    :data:`BLOCK_IDS` ids, which keeps an id as cheap as a formatted counter.
    """

    ID_BYTES = 12
    BLOCK_IDS = 170

    def __init__(self, client_headers: Sequence[str] = ()) -> None:
        # Lower case: a front request's header names are, and aiohttp's lookups ignore case.
        self.client_headers = tuple(name.lower() for name in (*client_headers, "X-Request-Id"))
        self._block = ""
        self._next = 0

    def next(self) -> str:
        start = self._next
        if start >= len(self._block):
            self._block = os.urandom(self.ID_BYTES * self.BLOCK_IDS).hex()
            start = 0
        self._next = end = start + 2 * self.ID_BYTES
        return self._block[start:end]

    def of(self, headers: Mapping[str, str]) -> tuple[str, str]:
        """(request id, upstream id) of a request with ``headers``: the client's id (the first
        of :attr:`client_headers` it sent) when it is sane, else a fresh one. A client's id
        gets a fresh suffix upstream, so its rid is no easier to guess than ours."""
        given = next((headers[name] for name in self.client_headers if name in headers), None)
        if (
            given
            and len(given) <= MAX_REQUEST_ID_LENGTH
            and given.isascii()
            and given.isprintable()
        ):
            return given, f"{given}-{self.next()}"
        fresh = self.next()
        return fresh, fresh
