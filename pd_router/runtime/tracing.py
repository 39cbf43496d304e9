"""Starting a process's tracing: :func:`start_tracing`, the one place that loads OpenTelemetry
(:mod:`pd_router.otel_tracing`), and only when ``[tracing] enabled``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pd_router.tracing import TracingConfig, grpc_port_warning

if TYPE_CHECKING:
    from pd_router.otel_tracing import Tracing

log = logging.getLogger("pd_router.tracing")


def start_tracing(config: TracingConfig, process: str) -> Tracing | None:
    """This process's tracing (``process`` names it in every span's resource), or None when
    tracing is off: then OpenTelemetry is not imported at all."""
    if not config.enabled:
        return None
    from pd_router.otel_tracing import Tracing

    warning = grpc_port_warning(config.endpoint)
    if warning is not None:
        log.warning(warning)
    return Tracing.start(config, process)
