"""The control plane's refusals, in a module of their own: the conversion runner raises them,
and so does the cluster (a claim another replica holds), which the runner itself calls, so
neither package imports the other for them."""

from __future__ import annotations

from pd_router.control.workers import Worker
from pd_router.errors import Conflict


class ConversionRefused(Conflict):
    """Refused before anything changed; ``reason`` is a stable code for scripts."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, details={"reason": reason})
        self.reason = reason


class AlreadyInRole(ConversionRefused):
    def __init__(self, worker: Worker) -> None:
        super().__init__("already_in_role", f"worker {worker.url} is already a {worker.role}")
        self.worker = worker
