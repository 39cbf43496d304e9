"""Fault injection state behind ``POST /fault`` (tests only; enabled with ``--enable-faults``).

Body fields, all optional and combinable:

- ``fail_next``: int, ``fail_status``: int (default 500) -- the next N generation requests fail
  with that status before doing anything; ``fail_message``: str -- their error message (e.g.
  SGLang's decode's "Decode transfer failed for request ..." for a KV hand-off that failed).
- ``delay_secs``: float -- every generation request waits this long (wall clock) before starting.
- ``hang_bootstrap``: bool -- the bootstrap server accepts connections but never answers.
- ``fail_next_switch``: bool -- the next role change fails during teardown, leaving the worker
  unhealthy (``safe_to_restore`` false), as SGLang does.
- ``lie_next_switch``: bool -- the next role change answers success but leaves the role as it
  was (a worker that lies; the router's verify step must catch it).
- ``native_only``: bool -- ``/pd_role``, ``/pd_drain`` and ``/convert_pd_role`` answer 404 and
  the ``X-PD-Role`` header is ignored, as on SGLang without server_patch (the router must fall
  back to the native protocol).
- ``unhealthy``: bool -- ``/health`` and ``/health_generate`` answer 503.
- ``exit_after_kv_publish``: bool -- the process exits right after its bootstrap server handed a
  room's payload to a decode, before the decode can read the KV it names (a transfer failure).
- ``stale_bootstrap``: str -- ``host:port`` of a prefill's bootstrap server that this decode's
  KV pulls never reach, as SGLang 0.5.23's decode keeps a round-tripped prefill's old endpoint:
  each pull hangs until the bootstrap timeout and the prefill waits for it as long; ``""`` ends
  it, and so does ``/pd_forget_prefill`` for that prefill (hidden by ``native_only``). Other
  prefills are served as usual (the timing engine; the torch engine ignores it).
- ``busy_switch_next``: int -- the next N role switches are refused as "not idle" although the
  load reads idle, as SGLang 0.5.23's decode refuses while the KV of an aborted transfer awaits
  its deferred release (no load field counts it).
- ``no_decode_graphs``: bool -- the worker keeps no decode graphs: every switch to decode needs
  ``decode_cuda_graph_memory_gb``, as SGLang run with ``--disable-cuda-graph`` (on the CPU)
  asks for it on each one.
- ``exit``: int -- the process exits with this code right after replying.
- ``clear``: bool -- reset every fault first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from pd_protocol.json_values import is_number
from pd_worker.errors import BadRequest

_FIELDS = {
    "fail_next": int,
    "fail_status": int,
    "fail_message": str,
    "delay_secs": float,
    "hang_bootstrap": bool,
    "fail_next_switch": bool,
    "lie_next_switch": bool,
    "native_only": bool,
    "unhealthy": bool,
    "exit_after_kv_publish": bool,
    "stale_bootstrap": str,
    "busy_switch_next": int,
    "no_decode_graphs": bool,
    "exit": int,
    "clear": bool,
}


@dataclass
class Faults:
    """Current faults of one worker process."""

    fail_next: int = 0
    fail_status: int = 500
    fail_message: str = ""
    delay_secs: float = 0.0
    hang_bootstrap: bool = False
    fail_next_switch: bool = False
    lie_next_switch: bool = False
    native_only: bool = False
    unhealthy: bool = False
    exit_after_kv_publish: bool = False
    stale_bootstrap: str = ""
    busy_switch_next: int = 0
    no_decode_graphs: bool = False

    def apply(self, body: dict[str, Any]) -> int | None:
        """Update from a ``POST /fault`` body; returns the requested exit code, if any.

        The whole body is checked before anything changes: a refused body leaves no fault set.
        """
        for key, value in body.items():
            expected = _FIELDS.get(key)
            if expected is None:
                raise BadRequest(f"unknown fault field {key!r}")
            if not _is_type(value, expected):
                raise BadRequest(f"fault field {key!r} must be {expected.__name__}")
        if "fail_status" in body and not 400 <= body["fail_status"] < 600:
            raise BadRequest("fail_status must be an HTTP error status (400-599)")
        if body.get("clear"):
            self.reset()
        for key in (
            "fail_next",
            "fail_status",
            "fail_message",
            "delay_secs",
            "hang_bootstrap",
            "fail_next_switch",
            "lie_next_switch",
            "native_only",
            "unhealthy",
            "exit_after_kv_publish",
            "stale_bootstrap",
            "busy_switch_next",
            "no_decode_graphs",
        ):
            if key in body:
                setattr(self, key, body[key])
        return body.get("exit")

    def reset(self) -> None:
        """Clear every fault."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    def take_failure(self) -> int | None:
        """Status to fail the current generation request with, consuming one ``fail_next``."""
        if self.fail_next <= 0:
            return None
        self.fail_next -= 1
        return self.fail_status

    def take_switch_failure(self) -> bool:
        """Whether this role change must fail (consumes the fault)."""
        failing = self.fail_next_switch
        self.fail_next_switch = False
        return failing

    def take_busy_switch(self) -> bool:
        """Whether this role switch must be refused as busy (consumes one)."""
        if self.busy_switch_next <= 0:
            return False
        self.busy_switch_next -= 1
        return True

    def take_switch_lie(self) -> bool:
        """Whether this role change must claim success without happening (consumes the fault)."""
        lying = self.lie_next_switch
        self.lie_next_switch = False
        return lying

    def snapshot(self) -> dict[str, Any]:
        return asdict(self)


def _is_type(value: Any, expected: type) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is float:
        return is_number(value)
    return isinstance(value, expected) and not isinstance(value, bool)
