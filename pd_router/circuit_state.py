"""The states of a worker's circuit, shared by the control side (which decides them,
:mod:`pd_router.control.circuit`) and the data planes (which route by them,
:mod:`pd_router.dataplane.routing.snapshot`)."""

from __future__ import annotations

from enum import StrEnum


class CircuitState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"
