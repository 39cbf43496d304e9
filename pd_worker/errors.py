"""Error classes of the worker, each carrying its HTTP status, mapped to responses in app.py.

Shapes follow SGLang 0.5.23: ``ValueError``-style request errors answer ``{"error": {"message"}}``
on native routes, while errors raised as FastAPI ``HTTPException`` (a scheduler abort with a
status code, such as a failed KV transfer) and every error on ``/v1/*`` answer OpenAI's
``ErrorResponse`` object.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pd_protocol.wire import RETRY_AFTER_SECS


class WorkerError(Exception):
    """Base class: ``status`` is the HTTP status; ``openai_shape`` picks the ErrorResponse body."""

    status: int = HTTPStatus.BAD_REQUEST
    openai_shape: bool = False
    retry_after: int | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self, openai_route: bool) -> dict[str, Any]:
        """The JSON body of the error response for a native or an OpenAI route."""
        if self.openai_shape or openai_route:
            return {
                "object": "error",
                "message": self.message,
                "type": self.error_type(openai_route),
                "param": None,
                "code": int(self.status),
            }
        return {"error": {"message": self.message}}

    def error_type(self, openai_route: bool) -> str:
        """``type`` of an ErrorResponse: SGLang writes the status as text for HTTPException."""
        if openai_route and not self.openai_shape:
            return "BadRequestError"
        return str(int(self.status))


class BadRequest(WorkerError):
    """A malformed or unsupported request body (SGLang's ValueError path)."""


class ContractError(BadRequest):
    """A ``/generate`` body that breaks SGLang's API schema (a field of the wrong type). SGLang's
    contract gate answers it before any stream opens, with the violation as a plain string
    (``{"error": "..."}``); the other request errors of a streaming ``/generate`` arrive as an
    error event in a 200 stream, since SGLang finds them only while generating."""

    def body(self, openai_route: bool) -> dict[str, Any]:
        if openai_route:
            return super().body(openai_route)
        return {"error": self.message}


class InvalidBody(WorkerError):
    """A body that does not fit the route's request type (FastAPI's validation on SGLang, which
    SGLang answers 400 in the ErrorResponse shape with the status phrase as ``type``)."""

    openai_shape = True

    def error_type(self, openai_route: bool) -> str:
        return HTTPStatus(self.status).phrase


class NotFound(WorkerError):
    """A route that exists only when enabled (``/fault`` without ``--enable-faults``)."""

    status = HTTPStatus.NOT_FOUND


class Unauthorized(WorkerError):
    """An admin route called without the configured admin API key."""

    status = HTTPStatus.UNAUTHORIZED


class NotAdmitting(WorkerError):
    """Admission is closed (draining or converting): come back later."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    openai_shape = True
    retry_after = RETRY_AFTER_SECS


class Misdirected(WorkerError):
    """A generation request sent for the other role than the worker's live one (its
    ``X-PD-Role`` header): 421 with the extension's body, which names the live role."""

    status = HTTPStatus.MISDIRECTED_REQUEST

    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(str(reply["error"]["message"]))
        self.reply = reply

    def body(self, openai_route: bool) -> dict[str, Any]:
        return self.reply


class Unhealthy(WorkerError):
    """The worker is not serving (starting, or unhealthy after a failed role switch)."""

    status = HTTPStatus.SERVICE_UNAVAILABLE
    openai_shape = True
    retry_after = 5


class InjectedFault(WorkerError):
    """A failure requested through ``POST /fault``."""

    openai_shape = True

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message or f"injected fault: status {status}")
        self.status = status


class RequestAborted(WorkerError):
    """A scheduler abort carrying a status code (SGLang's FINISH_ABORT with status_code)."""

    status: int = HTTPStatus.INTERNAL_SERVER_ERROR
    openai_shape = True

    def __init__(self, message: str, status: int = HTTPStatus.INTERNAL_SERVER_ERROR) -> None:
        super().__init__(message)
        self.status = status


class KVTransferError(Exception):
    """The KV of a bootstrap room could not be pulled (SGLang's common/conn.py KVTransferError)."""

    def __init__(self, bootstrap_room: int, failure_reason: str) -> None:
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason

    def __str__(self) -> str:
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"
