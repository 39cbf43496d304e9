"""A generation request's entry: parse its body once, find the pools of the model it names,
admit it, and serve it in PD (:class:`~pd_router.dataplane.path.proxy.Exchange`, each sample of
an ``n > 1`` request apart: :mod:`pd_router.dataplane.path.fanout`) or on one regular worker
(:class:`~pd_router.dataplane.path.single.Forward`)."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from pd_router.dataplane.front.reply import Answer, Reply
from pd_router.dataplane.path.collaborators import PathCollaborators
from pd_router.dataplane.path.fanout import Sampling, serve_samples
from pd_router.dataplane.path.proxy import Exchange
from pd_router.dataplane.path.requests import Endpoint, parse_body
from pd_router.dataplane.path.single import Forward
from pd_router.dataplane.routing.pools import Route

if TYPE_CHECKING:
    from pd_router.otel_tracing import RequestSpan


async def serve(
    path: PathCollaborators,
    endpoint: Endpoint,
    raw: bytes,
    reply: Reply,
    ids: tuple[str, str],
    span: RequestSpan | None = None,
) -> None:
    """Answer one generation request (its whole body ``raw``) on ``reply``; ``ids``: the
    request's id and the one its rids are made from; ``span``: its trace span (None: tracing
    off)."""
    started = asyncio.get_running_loop().time()
    body = parse_body(raw)
    route = path.pools.route(body.get("model"))
    items, samples = endpoint.count_items(body)
    async with path.admission.admitted():
        if route.regular:
            await Forward(path, reply, ids, endpoint, body, items, started, route, span).run()
            return
        if samples > 1:
            run = functools.partial(run_sample, path, endpoint, started, span, route)
            await serve_samples(Sampling(endpoint, body, samples), reply, ids, run)
            return
        await Exchange(path, reply, ids, endpoint, body, items, started, route, span).run()


async def run_sample(
    path: PathCollaborators,
    endpoint: Endpoint,
    started: float,
    span: RequestSpan | None,
    route: Route,
    reply: Answer,
    ids: tuple[str, str],
    body: dict[str, Any],
    items: int | None,
) -> None:
    """One sample of a fanned-out request, served as a request of its own (its attempts'
    legs in the request's span)."""
    await Exchange(path, reply, ids, endpoint, body, items, started, route, span).run()
