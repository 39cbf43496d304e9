"""aiohttp application of the reference worker: SGLang's HTTP routes plus the PD extension routes.

Errors are raised as :mod:`pd_worker.errors` classes (or the extension's ``ExtensionError``) and
mapped to responses in one place, :func:`error_middleware`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from pd_protocol.extension import ExtensionError, PDExtension
from pd_protocol.wire import (
    CONVERT_PATH,
    DRAIN_PATH,
    FORGET_PREFILL_PATH,
    ROLE_HEADER,
    ROLE_PATH,
    SWITCH_FIELDS,
    SWITCH_PATH,
)
from pd_worker import metrics, openai_api
from pd_worker import server_info as info
from pd_worker.config import WorkerConfig
from pd_worker.control import EngineBackend, switch_refusal, tokenizer_switch
from pd_worker.engine import NOT_DISAGGREGATED, SWITCH_REPLY_ROUTING, Engine
from pd_worker.errors import (
    BadRequest,
    ContractError,
    InjectedFault,
    Misdirected,
    NotAdmitting,
    NotFound,
    RequestAborted,
    Unauthorized,
    Unhealthy,
    WorkerError,
)
from pd_worker.faults import Faults
from pd_worker.protocol import abort_progress, parse_generate, response_dict, wants_stream
from pd_worker.requests import GenItem, Progress
from pd_worker.streams import final_results, merged
from pd_worker.validation import (
    chat_body,
    completion_body,
    generate_body,
    parse_json,
    pd_role_switch_body,
)

log = logging.getLogger(__name__)

EXIT_DELAY_SECS = 0.05
# How many generation requests' trace headers GET /trace_headers keeps (the latest).
TRACE_HEADERS_KEPT = 256
TRACE_HEADERS = ("traceparent", "tracestate", "x-request-id")


@dataclass
class WorkerState:
    """Everything the routes need; one per application (no module-level state)."""

    config: WorkerConfig
    engine: Engine
    faults: Faults
    extension: PDExtension
    registry: CollectorRegistry
    started: float = field(default_factory=time.time)
    # Role changes whose caller went away, kept until they end.
    orphaned_calls: set[asyncio.Task] = field(default_factory=set)
    # The W3C trace context (and request id) of the latest generation requests, oldest first:
    # what a tracing router propagated, as a worker that continues its trace would read it.
    trace_headers: deque[dict[str, str]] = field(
        default_factory=lambda: deque(maxlen=TRACE_HEADERS_KEPT)
    )


WORKER = web.AppKey("worker", WorkerState)
T = TypeVar("T")


def build_app(config: WorkerConfig) -> web.Application:
    """The worker application; the engine starts and stops with the app."""
    app = web.Application(
        middlewares=[error_middleware, api_key_middleware], client_max_size=64 * 1024 * 1024
    )
    faults = Faults()
    engine = Engine(config, faults)
    extension = PDExtension(EngineBackend(engine))
    engine.add_listener(extension.load_changed)
    app[WORKER] = WorkerState(config, engine, faults, extension, metrics.build_registry(engine))
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    _add_routes(app)
    return app


async def _start(app: web.Application) -> None:
    await app[WORKER].engine.start()


async def _stop(app: web.Application) -> None:
    await app[WORKER].engine.stop()


def _add_routes(app: web.Application) -> None:
    r = app.router
    for path in ("/health", "/health_generate"):
        r.add_get(path, health)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/model_info", model_info)
    r.add_get("/get_model_info", model_info)
    r.add_get("/v1/models", list_models)
    r.add_route("POST", "/generate", generate)
    r.add_route("PUT", "/generate", generate)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", completions)
    r.add_get("/v1/loads", v1_loads)
    r.add_get("/get_load", get_load)
    r.add_get("/torch_state", torch_state)
    r.add_get("/metrics", prometheus_metrics)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_post(SWITCH_PATH, pd_role_switch)
    r.add_get(ROLE_PATH, pd_role)
    r.add_post(DRAIN_PATH, pd_drain)
    r.add_post(CONVERT_PATH, convert_pd_role)
    r.add_post(FORGET_PREFILL_PATH, pd_forget_prefill)
    r.add_post("/fault", fault)
    r.add_get("/trace_headers", trace_headers)


# ---------------------------------------------------------------------------- errors


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """The one place where error classes become HTTP responses."""
    try:
        return await handler(request)
    except WorkerError as exc:
        openai_route = request.path.startswith("/v1/")
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
        return _json(exc.body(openai_route), int(exc.status), headers)
    except ExtensionError as exc:
        return _json(exc.body, exc.status)


@web.middleware
async def api_key_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """SGLang's ``--api-key``: with a key, every route but ``/health*`` and ``/metrics`` needs
    ``Authorization: Bearer <key>``."""
    key = request.app[WORKER].config.api_key
    if (
        key is not None
        and not request.path.startswith(("/health", "/metrics"))
        and request.headers.get("Authorization") != f"Bearer {key}"
    ):
        raise Unauthorized("Unauthorized")
    return await handler(request)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from None


async def _typed_body(request: web.Request) -> Any:
    """The body of a route SGLang declares with a request type (FastAPI parses it)."""
    return parse_json(await request.read())


def _require_admin(request: web.Request) -> None:
    """SGLang's ADMIN_OPTIONAL: when an admin key is configured, admin routes need it."""
    key = request.app[WORKER].config.admin_api_key
    if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
        raise Unauthorized("Unauthorized")


# ---------------------------------------------------------------------------- info routes


def _serving(state: WorkerState) -> bool:
    return (
        state.engine.serving
        and not state.engine.unhealthy_after_switch
        and not state.extension.failed
    )


async def health(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    healthy = _serving(state) and not state.faults.unhealthy
    return web.Response(status=200 if healthy else 503)


async def server_info(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    return _json(info.server_info(state.config, state.engine))


async def torch_state(request: web.Request) -> web.Response:
    """The torch engine's tensor identities (weights and KV pool data_ptr), free slots and
    transport: what a test compares across role switches."""
    state = request.app[WORKER].engine.plane.state()
    if state is None:
        raise NotFound("/torch_state needs --engine torch")
    return _json(state)


async def model_info(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    return _json(info.model_info(state.config, state.engine))


async def list_models(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    name = state.config.model_name
    model = {
        "id": name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "sglang",
        "root": name,
        "max_model_len": state.config.timing.max_total_num_tokens,
    }
    return _json({"object": "list", "data": [model]})


async def v1_loads(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    load = state.engine.loads()
    aggregate = {
        "total_running_reqs": load["num_running_reqs"],
        "total_waiting_reqs": load["num_waiting_reqs"],
        "total_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
        "avg_token_usage": load["token_usage"],
        "avg_throughput": load["gen_throughput"],
        "avg_utilization": load["utilization"],
    }
    return _json(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": info.SGLANG_VERSION,
            "dp_rank_count": 1,
            "loads": [load],
            "aggregate": aggregate,
        }
    )


async def get_load(request: web.Request) -> web.Response:
    load = request.app[WORKER].engine.loads()
    return _json(
        [
            {
                "dp_rank": 0,
                "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"],
                "num_tokens": load["num_used_tokens"],
            }
        ]
    )


async def prometheus_metrics(request: web.Request) -> web.Response:
    body = metrics.render(request.app[WORKER].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[WORKER].engine
    if not engine.is_fully_idle():
        return web.Response(
            status=400,
            text="Cache not flushed. There are running or waiting requests.",
        )
    engine.kv_pool.clear()
    engine.prefix_cache.clear()
    return web.Response(
        text="Cache flushed.\nPlease check backend logs for more details. "
        "(When there are running or waiting requests, the operation will not be performed.)"
    )


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    rid = body.get("rid")
    request.app[WORKER].engine.abort(
        rid if isinstance(rid, str) else None, bool(body.get("abort_all"))
    )
    return web.Response(status=200)


# ---------------------------------------------------------------------------- generation


async def _admit(state: WorkerState, request: web.Request) -> None:
    """Keep the request's trace headers, then refuse a generation request before any work
    when the worker cannot take it, in server_patch's order: draining (503), then sent for
    the other role (421; ignored under the ``native_only`` fault, as SGLang without
    server_patch ignores the header)."""
    _keep_trace_headers(state, request)
    if not _serving(state):
        raise Unhealthy("server is not healthy")
    if not state.extension.admits():
        raise NotAdmitting("server is draining; retry on another server")
    if not state.faults.native_only:
        misdirected = await state.extension.misdirected(request.headers.get(ROLE_HEADER))
        if misdirected is not None:
            raise Misdirected(misdirected)
    status = state.faults.take_failure()
    if status is not None:
        raise InjectedFault(status, state.faults.fail_message)
    if state.faults.delay_secs > 0:
        await asyncio.sleep(state.faults.delay_secs)


def _keep_trace_headers(state: WorkerState, request: web.Request) -> None:
    """Keep the trace context a generation request came with (requests without one leave no
    entry)."""
    if "traceparent" in request.headers:
        kept = {name: request.headers[name] for name in TRACE_HEADERS if name in request.headers}
        state.trace_headers.append({"path": request.path, **kept})


async def trace_headers(request: web.Request) -> web.Response:
    """The trace headers of the latest generation requests that had a ``traceparent``."""
    return _json({"requests": list(request.app[WORKER].trace_headers)})


def _validate(engine: Engine, items: list[GenItem]) -> None:
    """Checks that need the role, done before a stream opens so they answer 400 (a decode and
    a regular server hold the output's KV too)."""
    decode = engine.role_name == "decode"
    generates = engine.role_name != "prefill"
    for item in items:
        engine.check_fits(len(item.prompt_ids) + (item.max_new_tokens if generates else 0))
        if decode and not item.fake_transfer and not (item.bootstrap_host and item.bootstrap_port):
            raise BadRequest("bootstrap_host and bootstrap_port are required with bootstrap_room")


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[WORKER]
    await _admit(state, request)
    body = await _typed_body(request)
    generate_body(body)
    try:
        items, batch, stream = parse_generate(body, state.engine.plane.tokenize)
        _validate(state.engine, items)
    except ContractError:
        raise
    except BadRequest as exc:
        if not wants_stream(body):
            raise
        return await _stream_rejection(request, exc)
    started = time.monotonic()
    if stream:
        return await _stream_generate(request, state, items, batch, started)
    results = await final_results(state.engine.generate, items)
    outs = [
        response_dict(item, p, time.monotonic() - started)
        for item, p in zip(items, results, strict=True)
    ]
    return _json(outs if batch else outs[0])


async def _open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, payload: Any) -> None:
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")


async def _stream_generate(
    request: web.Request, state: WorkerState, items: list[GenItem], batch: bool, started: float
) -> web.StreamResponse:
    response = await _open_sse(request)
    latest: dict[int, Progress] = {}
    try:
        async for index, progress in merged(state.engine.generate, items):
            latest[index] = progress
            await _send(response, _event(items, index, progress, batch, started))
    except RequestAborted as exc:
        index = next((i for i in range(len(items)) if i not in latest or not latest[i].finished), 0)
        aborted = abort_progress(latest.get(index, Progress()), exc.message, int(exc.status))
        await _send(response, _event(items, index, aborted, batch, started))
    except BadRequest as exc:
        await _send(response, _stream_error_event(exc))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _stream_error_event(exc: BadRequest) -> dict[str, Any]:
    """The event SGLang's streaming ``/generate`` sends for a request error, before [DONE]."""
    return {
        "error": {
            "message": exc.message,
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }


async def _stream_rejection(request: web.Request, exc: BadRequest) -> web.StreamResponse:
    """A streaming ``/generate`` refused by a check SGLang makes only once the stream is open:
    200, the error event, then [DONE]."""
    response = await _open_sse(request)
    await _send(response, _stream_error_event(exc))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _event(
    items: list[GenItem], index: int, progress: Progress, batch: bool, started: float
) -> dict[str, Any]:
    out = response_dict(items[index], progress, time.monotonic() - started)
    if batch:
        out["index"] = index
    return out


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[WORKER]
    await _admit(state, request)
    body = await _typed_body(request)
    model = state.config.model_name
    if request.path.endswith("/chat/completions"):
        chat_body(body)
        parsed = openai_api.parse_chat(body, model, state.engine.plane.tokenize)
    else:
        completion_body(body)
        parsed = openai_api.parse_completion(body, model, state.engine.plane.tokenize)
    _validate(state.engine, parsed.items)
    if parsed.stream:
        return await _stream_openai(request, state, parsed)
    results = await final_results(state.engine.generate, parsed.items)
    return _json(openai_api.response(parsed, results))


async def _stream_openai(
    request: web.Request, state: WorkerState, parsed: openai_api.OpenAIRequest
) -> web.StreamResponse:
    response = await _open_sse(request)
    sent: dict[int, int] = {}
    latest: dict[int, Progress] = {}
    index = 0
    try:
        async for index, progress in merged(state.engine.generate, parsed.items):
            if index not in sent and parsed.kind == "chat":
                role = openai_api.chunk(parsed, index, "", None, first=True, sent_tokens=0)
                await _send(response, role)
            delta = progress.text[sent.get(index, 0) :]
            sent[index] = len(progress.text)
            previous = latest.get(index)
            sent_tokens = len(previous.output_ids) if previous is not None else 0
            latest[index] = progress
            event = openai_api.chunk(
                parsed, index, delta, progress, first=False, sent_tokens=sent_tokens
            )
            await _send(response, event)
        if parsed.include_usage:
            results = [latest.get(i, Progress()) for i in range(len(parsed.items))]
            await _send(response, openai_api.usage_chunk(parsed, results, index))
    except RequestAborted as exc:
        await _send(
            response, openai_api.stream_error(exc.message, int(exc.status), "INTERNAL_SERVER_ERROR")
        )
    except BadRequest as exc:
        await _send(response, openai_api.stream_error(exc.message, 400, "BadRequestError"))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# ---------------------------------------------------------------------------- PD control


async def pd_role_switch(request: web.Request) -> web.Response:
    """Native switch, routed through the extension so its epoch counts the change.

    The body is validated as FastAPI validates SGLang's request type, which keeps only the
    declared fields (unknown ones are ignored). Bodies the extension refuses for their role (no
    ``new_role``), calls during a running switch and ``prepare_only`` checks (which never change
    the role) get the native reply, so the messages stay SGLang's; any other refusal of the
    extension is answered in the native shape too (``old_role``, ``new_role``,
    ``safe_to_restore``: nothing changed).
    """
    _require_admin(request)
    state = request.app[WORKER]
    body = pd_role_switch_body(await _typed_body(request))
    if state.engine.switch_in_progress or body.get("prepare_only"):
        return _native_switch_reply(await tokenizer_switch(state.engine, body))
    fields = {name: value for name, value in body.items() if name in SWITCH_FIELDS}
    try:
        status, reply = await _to_the_end(state, state.extension.switch(fields))
    except ExtensionError as exc:
        if exc.body.get("field") == "new_role":
            return _native_switch_reply(await tokenizer_switch(state.engine, body))
        return _native_switch_reply(
            {
                **SWITCH_REPLY_ROUTING,
                "success": False,
                "message": exc.body["message"],
                "old_role": state.engine.role_name,
                "new_role": body.get("new_role", ""),
                "safe_to_restore": True,
            }
        )
    return _json(reply, status)


def _native_switch_reply(reply: dict[str, Any]) -> web.Response:
    return _json(reply, 200 if reply["success"] else 400)


def _require_extension(request: web.Request) -> None:
    """The ``native_only`` fault hides the extension routes, as on SGLang without server_patch."""
    if request.app[WORKER].faults.native_only:
        raise NotFound(f"{request.path} is not served (native_only fault)")


async def pd_role(request: web.Request) -> web.Response:
    _require_extension(request)
    return _json(await request.app[WORKER].extension.status())


async def pd_drain(request: web.Request) -> web.Response:
    _require_extension(request)
    _require_admin(request)
    return _json(await request.app[WORKER].extension.set_drain(await _body(request)))


async def pd_forget_prefill(request: web.Request) -> web.Response:
    _require_extension(request)
    _require_admin(request)
    return _json(await request.app[WORKER].extension.forget_prefill(await _body(request)))


async def convert_pd_role(request: web.Request) -> web.Response:
    """Drain and switch; a regular server refuses at once (nothing drained), in the reply shape
    of a refused conversion."""
    _require_extension(request)
    _require_admin(request)
    state = request.app[WORKER]
    if state.config.regular:
        body = await _body(request)
        refusal = switch_refusal(
            state.engine, body if isinstance(body, dict) else {}, NOT_DISAGGREGATED
        )
        return _json(dict(refusal, bootstrap_port=None, duration_s=0.0), 400)
    status, reply = await _to_the_end(state, state.extension.convert(await _body(request)))
    return _json(reply, status)


async def _to_the_end(state: WorkerState, change: Coroutine[Any, Any, T]) -> T:
    """Run a role change to its end even if its caller goes away: the server cancels a handler
    whose client disconnected (SGLang's does not), and a switch cut off half-way would leave the
    worker between roles. A router replica that died mid-conversion is then settled by another
    from the role the worker ends up in."""
    task = asyncio.ensure_future(change)
    state.orphaned_calls.add(task)
    task.add_done_callback(state.orphaned_calls.discard)
    return await asyncio.shield(task)


async def fault(request: web.Request) -> web.Response:
    """Fault injection (see pd_worker.faults); 404 unless the worker runs with --enable-faults."""
    state = request.app[WORKER]
    if not state.config.enable_faults:
        raise NotFound("fault injection is disabled (start the worker with --enable-faults)")
    _require_admin(request)
    body = await _body(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    exit_code = state.faults.apply(body)
    if exit_code is not None:
        log.warning("fault: exiting with code %d", exit_code)
        asyncio.get_running_loop().call_later(EXIT_DELAY_SECS, os._exit, exit_code)
    return _json({"success": True, "faults": state.faults.snapshot()})
