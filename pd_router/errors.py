"""The router's error classes and the one place that turns an error into an HTTP response.

Handlers raise; the error middleware in ``server.py`` calls :func:`error_response`. Every error
body has the same shape, ``{"error": {"message", "type", "code"}}`` (the OpenAI shape, which
SGLang clients already parse), so a client never sees a stack trace or an HTML page.
"""

from __future__ import annotations

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError


class RouterError(Exception):
    """An error with a status code, an error type and a message meant for the client."""

    status = 500
    error_type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        details: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers
        self.details = details or {}


class BadRequest(RouterError):
    status = 400
    error_type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    error_type = "authentication_error"


class NotFound(RouterError):
    status = 404
    error_type = "not_found"


class ModelNotFound(RouterError):
    """``GET /v1/models/{id}`` for a model no worker serves, in OpenAI's shape (SGLang's
    answer too): ``param`` and a string ``code`` a client's SDK maps to NotFoundError."""

    status = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model '{model}' does not exist",
            details={"param": "model", "code": "model_not_found"},
        )


class Conflict(RouterError):
    status = 409
    error_type = "conflict"


class RequestTimeout(RouterError, TimeoutError):
    """The client stopped sending its request body. A TimeoutError as well, so that aiohttp's
    server, which drains what is left of a body after the answer, treats it as the end of the
    body and closes the connection."""

    status = 408
    error_type = "request_timeout"


class PayloadTooLarge(RouterError):
    status = 413
    error_type = "payload_too_large"


class ClientClosedRequest(RouterError):
    """The client went away before its answer started (nginx's 499, for the metrics)."""

    status = 499
    error_type = "client_closed_request"


class NoWorkers(RouterError):
    """No selectable prefill or decode: the client should come back shortly."""

    status = 503
    error_type = "no_available_workers"

    def __init__(self, message: str, retry_after_secs: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_secs)})


class UpstreamError(RouterError):
    """A worker failed (transport error or 5xx) and the router could not recover."""

    status = 502
    error_type = "upstream_error"


class UpstreamUnavailable(RouterError):
    """Every worker tried answered 503 (draining, overloaded): the client should come back."""

    status = 503
    error_type = "upstream_unavailable"

    def __init__(self, message: str, retry_after_secs: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_secs)})


class RouterOverloaded(RouterError):
    """The router itself ran out of a resource (file descriptors, buffers, its connection cap
    to a worker): the workers are fine and the client should come back shortly."""

    status = 503
    error_type = "router_overloaded"

    def __init__(self, message: str, retry_after_secs: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_secs)})


class ClusterUnavailable(RouterError):
    """A step that needs the other router replicas' agreement (a conversion, adding or removing
    a worker) while etcd cannot be reached; routing goes on meanwhile."""

    status = 503
    error_type = "cluster_unavailable"

    def __init__(self, message: str, retry_after_secs: int = 5) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_secs)})


class UpstreamTimeout(RouterError):
    status = 504
    error_type = "upstream_timeout"


# Errors the middleware turns into responses with error_response(); anything else is a 500.
MAPPED_ERRORS = (RouterError, web.HTTPException, web.RequestPayloadError)


def error_body(
    status: int, error_type: str, message: str, details: dict[str, str] | None = None
) -> bytes:
    """The error object; ``details`` are machine-readable fields (a refusal's ``reason``, the
    ``field`` a 400 is about) so clients need not parse the message."""
    error = {"message": message, "type": error_type, "code": status, **(details or {})}
    return orjson.dumps({"error": error})


def json_error(
    status: int,
    error_type: str,
    message: str,
    headers: dict[str, str] | None = None,
    details: dict[str, str] | None = None,
) -> web.Response:
    return web.Response(
        body=error_body(status, error_type, message, details),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def error_response(exc: Exception) -> web.Response:
    """The HTTP response for any error a handler may raise (the one mapping)."""
    if isinstance(exc, RouterError):
        return json_error(exc.status, exc.error_type, exc.message, exc.headers, exc.details)
    if isinstance(exc, web.HTTPException):
        return json_error(exc.status, http_error_type(exc.status), exc.reason or exc.text or "")
    if isinstance(exc, web.RequestPayloadError):
        return json_error(400, "invalid_request_error", payload_error_message(exc))
    return json_error(500, "internal_error", "internal router error")


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
