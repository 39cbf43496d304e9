"""One request as a client connection parsed it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_router.errors import RouterError


@dataclass(slots=True, eq=False)
class ClientRequest:
    """A request's head and body. ``headers`` maps lower-case names to values (repeated
    headers joined with ", "); ``raw_headers`` keeps them as sent, for the relay."""

    method: str = ""
    target: bytes = b""
    path: str = ""
    version: str = "1.1"
    raw_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    keep_alive: bool = True
    # Bytes of the body budget this request holds (released once it is answered or dropped).
    admitted: int = 0
    # Why the request is refused before it is served (too large, too slow, malformed).
    rejection: RouterError | None = None

    def header(self, name: str) -> str | None:
        """A header by its lower-case name."""
        return self.headers.get(name)
