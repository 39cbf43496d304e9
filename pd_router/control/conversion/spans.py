"""A finished conversion as a trace: :func:`conversion_span`.

The span tree is read from the conversion's record once it ended (its phases have their
timestamps; the canary and a switch back are replies the record kept with their time and
duration), so the runner only hands the record over, and nothing here imports OpenTelemetry.
The tree: ``conversion`` (worker, roles, who started it, outcome), a child per phase it
entered (``drain``, ``switch``, ``verify``), and under ``verify`` the ``canary`` request and,
when the canary failed, the ``switch_back``.
"""

from __future__ import annotations

from pd_router.control.conversion.history import Conversion, PhaseRecord, Status
from pd_router.tracing import SpanRecord

# Outcomes that are no failure of the conversion: done, or stopped on purpose.
NOT_ERRORS = frozenset({Status.SUCCEEDED, Status.ABORTED})
# The replies under verify that are spans of their own, and the timing that says how long each
# took (it ended when its reply was kept).
VERIFY_STEPS = {"canary": "canary_s", "switch_back": "switch_back_s"}


def conversion_span(conv: Conversion) -> SpanRecord:
    """The span of ``conv`` (finished) with its phases as children."""
    end = conv.finished_at if conv.finished_at is not None else conv.created_at
    attributes = {
        "pd.conversion.id": conv.id,
        "pd.conversion.worker": conv.worker.url,
        "pd.conversion.from_role": conv.from_role.value,
        "pd.conversion.to_role": conv.to_role.value,
        "pd.conversion.started_by": conv.request.started_by,
        "pd.conversion.outcome": conv.status.value,
        "pd.conversion.protocol": conv.protocol,
    }
    if conv.message:
        attributes["pd.conversion.message"] = conv.message
    return SpanRecord(
        "conversion",
        conv.created_at,
        end,
        attributes,
        error=None if conv.status in NOT_ERRORS else conv.message,
        children=tuple(phase_span(conv, phase, end) for phase in conv.phases),
    )


def phase_span(conv: Conversion, phase: PhaseRecord, end: float) -> SpanRecord:
    """One phase; one that never ended (it cannot, once the conversion finished) ends with
    the conversion."""
    children = verify_steps(conv) if phase.name == "verify" else ()
    ended = phase.ended_at if phase.ended_at is not None else end
    attributes = {"pd.conversion.phase": phase.name}
    return SpanRecord(phase.name, phase.started_at, ended, attributes, children=children)


def verify_steps(conv: Conversion) -> tuple[SpanRecord, ...]:
    """The canary and the switch back, from their replies (ended at ``at``, lasting their
    timing)."""
    steps = []
    for reply in conv.worker_replies:
        timing = VERIFY_STEPS.get(reply["call"])
        if timing is None or timing not in conv.timings:
            continue
        status = reply["status"]
        failed = isinstance(status, int) and status >= 300
        steps.append(
            SpanRecord(
                reply["call"],
                reply["at"] - conv.timings[timing],
                reply["at"],
                {"pd.conversion.step": reply["call"]},
                error=f"answered {status}" if failed else None,
            )
        )
    return tuple(steps)
