"""The control plane's refusals: plain exceptions that say what was refused and why.

They live in a module of their own because the conversion runner raises them and so does the
cluster (a claim another replica holds), which the runner itself calls. Neither knows of HTTP:
``pd_router.api.errors`` maps each class to its status code and error type.
"""

from __future__ import annotations

from pd_router.control.worker_control import ControlError
from pd_router.control.workers import Role, Worker


class ConversionRefused(Exception):
    """Refused before anything changed; ``reason`` is a stable code for scripts."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class AlreadyInRole(ConversionRefused):
    def __init__(self, worker: Worker) -> None:
        super().__init__("already_in_role", f"worker {worker.url} is already a {worker.role}")
        self.worker = worker


class NotConvertible(ConversionRefused):
    """A regular (non-PD) worker, or a conversion to the regular role: SGLang switches a
    server between prefill and decode only."""

    def __init__(self, worker: Worker) -> None:
        what = (
            f"worker {worker.url} is a regular (non-PD) server"
            if worker.role is Role.REGULAR
            else f"worker {worker.url} cannot become a regular server"
        )
        super().__init__(
            "not_convertible", f"{what}: a conversion moves a server between prefill and decode"
        )
        self.worker = worker


class KnobNotAccepted(Exception):
    """A PR #9325 knob sent for a worker whose control API (native SGLang) takes none; ``field``
    names it."""

    def __init__(self, name: str, worker: Worker) -> None:
        super().__init__(
            f"{name} is not accepted by the control API of {worker.url} (native /pd_role_switch)"
        )
        self.field = name


class WorkerUnreachable(Exception):
    """The worker to convert did not answer its first control call: nothing changed."""

    def __init__(self, error: ControlError) -> None:
        super().__init__(f"worker not reachable, nothing changed: {error}")


class ClusterUnavailable(Exception):
    """A step that needs the other router replicas' agreement (a conversion, adding or removing
    a worker) while etcd cannot be reached; routing goes on meanwhile, and the caller may try
    again after ``retry_after_secs``."""

    retry_after_secs = 5
