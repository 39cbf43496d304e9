"""Which data plane may send a worker's half-open trial: one for the whole router.

A half-open circuit lets one trial request through for the whole router; N data planes
deciding alone would let N. So every snapshot names, for each worker whose circuit is not
closed, the one data plane that may send its trial (none: nobody may). It is the one with the
most client connections when the circuit opened, the likeliest to have a request soon.

A trial moves to another data plane when its holder exited, or has neither a client connection
nor a request in flight on the worker while another has clients. What the control process knows
of a data plane is its last report, and the holder may have sent the trial since. So a move
is made in two steps: a snapshot names nobody, and only once the old holder has acked that
snapshot and reports nothing in flight on the worker does the next snapshot name the new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, Protocol


class PlaneView(Protocol):
    """What the trials read of a data plane: its last report."""

    acked: int
    connections: int
    inflight: Mapping[str, int]


@dataclass(frozen=True)
class Revoked:
    """The trial was taken from ``plane`` in snapshot ``version``: nobody else gets it before
    that data plane acked the snapshot and has nothing in flight on the worker."""

    plane: int
    version: int


@dataclass(frozen=True)
class Take:
    """The next snapshot takes the trial from ``plane``."""

    plane: int


# The next snapshot still names nobody: the old holder of a move may still be sending its trial.
WAIT: Final = "wait"

Step = int | None | Take | Literal["wait"]


class HalfOpenTrials:
    """The holder of every not-closed circuit's trial, and the moves in progress."""

    def __init__(self) -> None:
        self._holders: dict[str, int | None] = {}
        self._revoked: dict[str, Revoked] = {}

    def holder(
        self, url: str, closed: bool, planes: Mapping[int, PlaneView], version: int
    ) -> int | None:
        """The data plane that snapshot ``version`` names for ``url``'s trial (None: nobody)."""
        if closed:
            self._holders.pop(url, None)
            self._revoked.pop(url, None)
            return None
        step = self._next(url, planes)
        if step == WAIT:
            return None
        if isinstance(step, Take):
            self._revoked[url] = Revoked(step.plane, version)
            self._holders[url] = None
            return None
        self._revoked.pop(url, None)
        self._holders[url] = step
        return step

    def unsettled(self, planes: Mapping[int, PlaneView]) -> bool:
        """Whether a new snapshot would name another holder for some trial."""
        for url, holder in self._holders.items():
            step = self._next(url, planes)
            if step != WAIT and step != holder:
                return True
        return False

    def forget(self, known: set[str]) -> None:
        """Drop the workers that are no longer in the registry."""
        for url in [url for url in self._holders if url not in known]:
            self._holders.pop(url)
            self._revoked.pop(url, None)

    def _next(self, url: str, planes: Mapping[int, PlaneView]) -> Step:
        """What the next snapshot should do for ``url``'s trial: name a holder (or nobody),
        take it from its holder, or wait for the old holder of a move."""
        revoked = self._revoked.get(url)
        if revoked is not None:
            old = planes.get(revoked.plane)
            if old is not None and (old.acked < revoked.version or old.inflight.get(url)):
                return WAIT
        holder = self._holders.get(url)
        loads = {i: (plane.connections, plane.inflight.get(url, 0)) for i, plane in planes.items()}
        wanted = trial_plane(holder, loads)
        if holder is not None and wanted != holder and holder in planes:
            return Take(holder)
        return wanted


def trial_plane(holder: int | None, loads: dict[int, tuple[int, int]]) -> int | None:
    """The data plane that should send a worker's half-open trial, given each connected one's
    (client connections, requests in flight on the worker). The one holding it keeps it unless
    it exited, or has neither while another has clients; a trial may be in flight while it has
    either. A new one is the one with the most connections (the lowest number on a tie)."""
    if not loads:
        return None
    if holder in loads:
        connections, inflight = loads[holder]
        if connections or inflight or not any(c for c, _ in loads.values()):
            return holder
    return max(loads, key=lambda plane: (loads[plane][0], -plane))
