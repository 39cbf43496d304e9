"""Admission of request bodies: the size limit of one body and the budget of all bodies in
flight at once, both checked from ``Content-Length`` before any of the body is read.

The router holds a body about three times while it routes it (the bytes read, the parsed
object it keeps for retries, the bytes it sends), from the first byte read until the answer
ends, so the budget bounds the memory that concurrent large requests can take: a request that
does not fit in what is left is refused with 503 and ``Retry-After`` instead of being read. A
request arriving when nothing is in flight always fits (up to ``max_payload_size``). A chunked
body (no ``Content-Length``) is checked against ``max_payload_size`` as it is read, by aiohttp,
and is not counted in the budget.
"""

from __future__ import annotations

from pd_router.errors import PayloadTooLarge, RouterError


class BodyBudgetExhausted(RouterError):
    status = 503
    error_type = "overloaded"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class BodyAdmission:
    """``max_payload_size`` per body; ``budget`` bytes of bodies in flight (0: no budget)."""

    def __init__(self, max_payload_size: int, budget: int) -> None:
        self.max_payload_size = max_payload_size
        self.budget = budget
        self.in_flight = 0

    def check_size(self, length: int) -> None:
        """PayloadTooLarge for a body of more than ``max_payload_size`` bytes."""
        if length > self.max_payload_size:
            raise PayloadTooLarge(
                f"request body of {length} bytes is over the limit of "
                f"{self.max_payload_size} bytes (max_payload_size)"
            )

    def admit(self, length: int) -> None:
        """Count a body of ``length`` bytes in (give it back with :meth:`release`), or raise
        PayloadTooLarge / BodyBudgetExhausted."""
        self.check_size(length)
        if self.budget and self.in_flight and self.in_flight + length > self.budget:
            raise BodyBudgetExhausted(
                f"{self.in_flight} bytes of request bodies are in flight; this one's "
                f"{length} would exceed max_inflight_body_bytes ({self.budget}); retry shortly"
            )
        self.in_flight += length

    def release(self, length: int) -> None:
        self.in_flight -= length
