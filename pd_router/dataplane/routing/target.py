"""A worker as the request path and the policies see it: a snapshot's member in a data plane
(:mod:`pd_router.dataplane.routing.snapshot`); the policies take the registry's workers too."""

from __future__ import annotations

from typing import Protocol

from pd_router.roles import Role


class Verdicts(Protocol):
    """The worker's circuit, as the legs feed it."""

    def on_dispatch(self) -> None: ...
    def record_success(self) -> None: ...
    def record_failure(self) -> None: ...
    def release_trial(self) -> None: ...


class Target(Protocol):
    url: str
    role: Role
    bootstrap_host: str
    bootstrap_port: int | None
    inflight: int
    circuit: Verdicts
    # The worker's requests (running + waiting) by its own last report (None: no report), and
    # when the control side read that report: ``least_load`` routes by them.
    load: int | None
    load_at: float
