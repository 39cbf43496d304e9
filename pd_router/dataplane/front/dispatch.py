"""What happens to each request a client connection parsed: its id, its body's admission, the
CORS headers, one mapping from errors to JSON answers, the request metrics, and the route:
the generation endpoints to the request path (:mod:`pd_router.dataplane.path.proxy`), everything
else to the relay."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pd_router.dataplane.front.admission import BodyAdmission
from pd_router.dataplane.front.cors import CorsPolicy
from pd_router.dataplane.front.encoding import decoded_body
from pd_router.dataplane.front.ids import RequestIds
from pd_router.dataplane.front.reply import Reply
from pd_router.dataplane.front.request import ClientRequest
from pd_router.dataplane.path.collaborators import PathCollaborators
from pd_router.dataplane.path.requests import CHAT, COMPLETIONS, GENERATE, Endpoint
from pd_router.dataplane.path.serve import serve
from pd_router.errors import ClientClosedRequest, RouterError, error_body

log = logging.getLogger("pd_router.dataplane.front")

ROUTES = {endpoint.path: endpoint for endpoint in (GENERATE, COMPLETIONS, CHAT)}
JSON = "application/json"

Relay = Callable[[ClientRequest, Reply], Awaitable[None]]


class MethodNotAllowed(RouterError):
    status = 405
    error_type = "method_not_allowed"


@dataclass(frozen=True, slots=True)
class FrontPolicy:
    """The request-level settings of the client side."""

    ids: RequestIds
    admission: BodyAdmission
    cors: CorsPolicy | None


def content_length(request: ClientRequest) -> int:
    """The declared body length (httptools has checked it is a number)."""
    value = request.headers.get("content-length")
    return int(value) if value else 0


async def send_error(reply: Reply, exc: RouterError) -> None:
    body = error_body(exc.status, exc.error_type, exc.message, exc.details)
    await reply.send(exc.status, body, JSON, exc.headers.items() if exc.headers else ())


class Dispatcher:
    """Serves the requests of every client connection of one process."""

    def __init__(self, path: PathCollaborators, relay: Relay, policy: FrontPolicy) -> None:
        self._path = path
        self._relay = relay
        self._ids = policy.ids
        self._admission = policy.admission
        self._cors = policy.cors
        self.max_body = policy.admission.max_payload_size

    def check_head(self, request: ClientRequest) -> RouterError | None:
        """Refuse a body over the size limit (any route: the relay reads bodies whole too), and
        count a generation request's body in the budget of bodies in flight."""
        length = content_length(request)
        if not length:
            return None
        try:
            if request.path in ROUTES and request.method == "POST":
                self._admission.admit(length)
                request.admitted = length
            else:
                self._admission.check_size(length)
        except RouterError as exc:
            return exc
        return None

    def release(self, request: ClientRequest) -> None:
        if request.admitted:
            self._admission.release(request.admitted)
            request.admitted = 0

    async def __call__(self, request: ClientRequest, reply: Reply) -> None:
        endpoint = ROUTES.get(request.path)
        if endpoint is None and request.rejection is None:
            await self._relayed(request, reply)
            return
        if self._cors is not None and request.method == "OPTIONS" and request.rejection is None:
            await self._relayed(request, reply)  # a CORS preflight: the application answers
            return
        await self._generation(request, reply, endpoint)

    async def _relayed(self, request: ClientRequest, reply: Reply) -> None:
        try:
            await self._relay(request, reply)
        except RouterError as exc:
            if not reply.started:
                await self._answer_error(reply, exc)
        except ConnectionResetError:
            pass

    async def _generation(
        self, request: ClientRequest, reply: Reply, endpoint: Endpoint | None
    ) -> None:
        path = self._path
        loop = asyncio.get_running_loop()
        started = loop.time()
        request_id, upstream_id = self._ids.of(request.headers)
        reply.common.append(("X-Request-Id", request_id))
        if self._cors is not None:
            reply.common.extend(self._cors.answer_headers(request.headers.get("origin")))
        label = endpoint.path if endpoint is not None else "unmatched"
        tracer = path.tracer
        span = (
            None
            if tracer is None
            else tracer.request(request.method, label, request.headers, request_id)
        )
        try:
            if request.rejection is not None:
                raise request.rejection
            if request.method != "POST":
                raise MethodNotAllowed("Method Not Allowed", headers={"Allow": "POST"})
            assert endpoint is not None
            raw = bytes(request.body)
            encoding = request.headers.get("content-encoding")
            if encoding:
                raw = decoded_body(raw, encoding, self.max_body)
            await serve(path, endpoint, raw, reply, (request_id, upstream_id), span)
        except asyncio.CancelledError:
            status = reply.delivered or ClientClosedRequest.status
            path.metrics.observe_request(label, status, loop.time() - started)
            if span is not None:
                span.finish(status)
            raise
        except RouterError as exc:
            await self._answer_error(reply, exc)
        except ConnectionResetError:
            reply.status = reply.delivered or ClientClosedRequest.status
        except Exception:
            log.exception("unhandled error", extra={"request_id": request_id, "path": request.path})
            await self._answer_error(reply, RouterError("internal router error"))
        finally:
            self.release(request)
        path.metrics.observe_request(label, reply.status, loop.time() - started)
        if span is not None:
            span.finish(reply.status)

    async def _answer_error(self, reply: Reply, exc: RouterError) -> None:
        """``exc`` as the answer, unless one was started (then the connection just ends)."""
        if reply.started:
            return
        try:
            await send_error(reply, exc)
        except ConnectionResetError:
            reply.status = ClientClosedRequest.status
