"""The one place that turns an error a handler raised into an HTTP response.

The router's own HTTP errors (:class:`pd_router.errors.RouterError`) carry their status; the
control plane's refusals are plain exceptions, and :data:`CONTROL_ERRORS` says what each one
answers. Every error body has the same shape, ``{"error": {"message", "type", "code"}}`` (the
OpenAI shape, which SGLang clients already parse), so a client never sees a stack trace or an
HTML page.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from pd_router.control.conversion.history import ConversionNotFound
from pd_router.control.errors import (
    ClusterUnavailable,
    ConversionRefused,
    KnobNotAccepted,
    WorkerUnreachable,
)
from pd_router.control.workers import RegistryError, UnknownWorker
from pd_router.errors import RouterError, json_error


@dataclass(frozen=True)
class Answer:
    """What a control error answers: its status and error type, the attributes of the error
    the body names too (machine-readable, so scripts need not parse the message), and whether
    it says when to come back (``Retry-After`` from the error's ``retry_after_secs``)."""

    status: int
    error_type: str
    fields: tuple[str, ...] = ()
    retry_after: bool = False


# A class's answer is that of the nearest class in its MRO listed here.
CONTROL_ERRORS: dict[type[Exception], Answer] = {
    UnknownWorker: Answer(404, "not_found"),
    RegistryError: Answer(409, "conflict"),
    ConversionNotFound: Answer(404, "not_found"),
    ConversionRefused: Answer(409, "conflict", fields=("reason",)),
    KnobNotAccepted: Answer(400, "invalid_request_error", fields=("field",)),
    WorkerUnreachable: Answer(502, "upstream_error"),
    ClusterUnavailable: Answer(503, "cluster_unavailable", retry_after=True),
}

# Errors the middleware turns into responses with error_response(); anything else is a 500.
MAPPED_ERRORS: tuple[type[Exception], ...] = (
    RouterError,
    web.HTTPException,
    web.RequestPayloadError,
    *CONTROL_ERRORS,
)


def error_response(exc: Exception) -> web.Response:
    """The HTTP response for any error a handler may raise (the one mapping)."""
    if isinstance(exc, RouterError):
        return json_error(exc.status, exc.error_type, exc.message, exc.headers, exc.details)
    if isinstance(exc, web.HTTPException):
        return json_error(exc.status, http_error_type(exc.status), exc.reason or exc.text or "")
    if isinstance(exc, web.RequestPayloadError):
        return json_error(400, "invalid_request_error", payload_error_message(exc))
    answer = control_answer(exc)
    if answer is not None:
        headers = {"Retry-After": str(exc.retry_after_secs)} if answer.retry_after else None
        details = {name: getattr(exc, name) for name in answer.fields}
        return json_error(answer.status, answer.error_type, str(exc), headers, details)
    return json_error(500, "internal_error", "internal router error")


def control_answer(exc: Exception) -> Answer | None:
    """The answer of the nearest class of ``exc`` that :data:`CONTROL_ERRORS` lists."""
    for cls in type(exc).__mro__:
        answer = CONTROL_ERRORS.get(cls)
        if answer is not None:
            return answer
    return None


def payload_error_message(exc: web.RequestPayloadError) -> str:
    """Why aiohttp could not read a request body (bad chunking, a Content-Encoding the body
    does not have): the parser's own message, which the wrapping error only holds as text."""
    cause = exc.__cause__
    detail = cause.message if isinstance(cause, HttpProcessingError) else str(exc)
    return f"request body could not be read: {' '.join(str(detail).split())}"


def http_error_type(status: int) -> str:
    return {
        404: "not_found",
        405: "method_not_allowed",
        408: "request_timeout",
        413: "payload_too_large",
        503: "service_unavailable",
    }.get(status, "invalid_request_error" if status < 500 else "internal_error")
