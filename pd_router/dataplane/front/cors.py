"""Which origins may read the router's answers (``cors_allowed_origins``; ``"*"``: any)."""

from __future__ import annotations

EXPOSED_HEADERS = "X-Request-Id, Retry-After"


class CorsPolicy:
    """Which origins may read the router's answers."""

    __slots__ = ("_any", "_origins")

    def __init__(self, origins: tuple[str, ...]) -> None:
        self._any = "*" in origins
        self._origins = frozenset(origins)

    def allow_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin``, or None
        when that origin is not allowed (or the request names none)."""
        if origin is None:
            return None
        if self._any:
            return "*"
        return origin if origin in self._origins else None

    def answer_headers(self, origin: str | None) -> list[tuple[str, str]]:
        """The headers that let a page from ``origin`` read an answer (none for another)."""
        allowed = self.allow_origin(origin)
        if allowed is None:
            return []
        return [
            ("Access-Control-Allow-Origin", allowed),
            ("Access-Control-Expose-Headers", EXPOSED_HEADERS),
            ("Vary", "Origin"),
        ]
