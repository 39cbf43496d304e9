"""The router's HTTP errors: each class carries its status code, error type and message for the
client, and :func:`error_body` writes them in the one shape every error body has,
``{"error": {"message", "type", "code"}}`` (the OpenAI shape, which SGLang clients already
parse).

The request path raises them and the data plane's front answers them; handlers raise them and
the application's error middleware answers them through :mod:`pd_router.api.errors`, which
maps the control plane's plain refusals as well.
"""

from __future__ import annotations

import orjson
from aiohttp import web


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
    """A request for, or ``GET /v1/models/{id}`` of, a model no worker serves, in OpenAI's
    shape (SGLang's answer too): ``param`` and a string ``code`` a client's SDK maps to
    NotFoundError."""

    status = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model '{model}' does not exist",
            details={"param": "model", "code": "model_not_found"},
        )


class ModelRequired(RouterError):
    """A request that names no model while the workers serve several: which one is the
    client's to say."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, models: list[str]) -> None:
        super().__init__(
            f"this router serves several models ({', '.join(models)}): name one in 'model'",
            details={"param": "model", "code": "model_required"},
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


class UpstreamTimeout(RouterError):
    status = 504
    error_type = "upstream_timeout"


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
