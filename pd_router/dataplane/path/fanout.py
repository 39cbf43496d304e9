"""Parallel sampling (``n > 1``) on PD, served as ``n`` requests of one sample each.

SGLang 0.5.23 cannot serve ``n > 1`` in PD mode: its tokenizer manager first sends a
prefix-caching warm-up (``max_new_tokens`` 0), then one request per sample under rooms
``room + i``; the prefill answers them, the decode never does, and the request would hang until
the rendezvous wait. So the router sends such a request as ``n`` PD requests with ``n = 1``, each
with its own pair, rooms, rid (``<id>-n<sample>``) and retries, all at once, and merges their
answers into what a colocated SGLang server answers for ``n > 1``:

- native ``/generate``: a list of ``B * n`` items for ``B`` prompts, prompt-major (item
  ``p * n + s`` is sample ``s`` of prompt ``p``, the order the tokenizer manager expands them
  in); OpenAI: ``choices`` with ``index`` ``p * n + s``, ``usage`` with the prompt tokens once
  per prompt (sample 0's) and the completion and reasoning tokens of every sample;
- streams: the samples' events interleaved as they come, each index rewritten to ``p * n + s``,
  their usage chunks merged into one, one final ``[DONE]``.

A client's seed (``sampling_seed``, OpenAI ``seed``) becomes ``seed + s`` for sample ``s``
(wrapping within 64 bits), so seeded samples differ from one another; a client's rid becomes
``rid_<item>`` as SGLang names the items of a batch. A sample that fails before anything of it
reached the client is retried by its own request path; one that fails for good fails the whole
request: the other samples are cancelled (their legs aborted) and the client gets one error, an
SSE error event once the stream began.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import orjson

from pd_protocol.json_values import is_int
from pd_router.dataplane.front.reply import Answer, Headers, Reply, sse_error_event
from pd_router.dataplane.path.logprobs import event_payload
from pd_router.dataplane.path.requests import Endpoint
from pd_router.errors import BadRequest, RouterError, UpstreamError

END_EVENT = b"data: [DONE]\n\n"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ERROR_EXCERPT_CHARS = 500

RunSample = Callable[
    [Answer, tuple[str, str], dict[str, Any], int | None], Coroutine[Any, Any, None]
]
"""Serves one sample's body on an answer: (answer, (request id, upstream id), body, items)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request with ``n = samples > 1``: its endpoint and parsed body."""

    endpoint: Endpoint
    body: dict[str, Any]
    samples: int


def sample_seed(seed: Any, sample: int) -> Any:
    """Sample ``sample``'s seed: ``seed + sample`` within 64 bits; anything that is not an
    int64 is left for the worker to refuse."""
    if not is_int(seed) or not INT64_MIN <= seed <= INT64_MAX:
        return seed
    return (seed + sample - INT64_MIN) % 2**64 + INT64_MIN


def one_sample_params(params: dict[str, Any], sample: int) -> dict[str, Any]:
    """Native ``sampling_params`` of one sample: ``n`` 1, its own seed."""
    params = {**params, "n": 1}
    if "sampling_seed" in params:
        params["sampling_seed"] = sample_seed(params["sampling_seed"], sample)
    return params


def one_sample_body(sampling: Sampling, sample: int) -> dict[str, Any]:
    """The body of sample ``sample``: the client's, with ``n`` 1 and the sample's seed."""
    body = dict(sampling.body)
    if not sampling.endpoint.native:
        body["n"] = 1
        if "seed" in body:
            body["seed"] = sample_seed(body["seed"], sample)
        return body
    params = body["sampling_params"]
    if isinstance(params, dict):
        body["sampling_params"] = one_sample_params(params, sample)
        return body
    if any(p.get("n", 1) != sampling.samples for p in params):
        raise BadRequest(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    body["sampling_params"] = [one_sample_params(p, sample) for p in params]
    return body


def sample_rid(rid: Any, sample: int, samples: int, prompts: int | None) -> Any:
    """Sample ``sample``'s rid from the client's: SGLang names item ``i`` of a request with a
    string rid ``rid_i`` (items prompt-major), and sample ``s`` of a prompt given its own rid
    ``rid_s``."""
    if isinstance(rid, list):
        return [f"{r}_{sample}" for r in rid]
    if prompts is None:
        return f"{rid}_{sample}"
    return [f"{rid}_{p * samples + sample}" for p in range(prompts)]


def sample_bodies(sampling: Sampling) -> tuple[list[dict[str, Any]], int | None]:
    """The bodies of every sample and the prompt count of each (None: a single prompt)."""
    bodies = [one_sample_body(sampling, s) for s in range(sampling.samples)]
    prompts, _ = sampling.endpoint.count_items(bodies[0])
    rid = sampling.body.get("rid")
    if rid is not None:
        for sample, body in enumerate(bodies):
            body["rid"] = sample_rid(rid, sample, sampling.samples, prompts)
    return bodies, prompts


def renumber(index: Any, sample: int, samples: int) -> Any:
    """The client's index of item ``index`` of sample ``sample``'s answer."""
    return index * samples + sample if is_int(index) else index


def merged_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of ``n`` samples as SGLang's ``UsageProcessor`` counts it: prompt tokens (and
    their details) once, from sample 0; completion and reasoning tokens summed."""
    usage = dict(usages[0])
    completion = sum(u.get("completion_tokens") or 0 for u in usages)
    usage["completion_tokens"] = completion
    usage["total_tokens"] = (usage.get("prompt_tokens") or 0) + completion
    if "reasoning_tokens" in usage:
        reasoning = sum(u.get("reasoning_tokens") or 0 for u in usages)
        usage["reasoning_tokens"] = reasoning
        if reasoning:
            details = usage.get("completion_tokens_details") or {}
            usage["completion_tokens_details"] = {**details, "reasoning_tokens": reasoning}
    return usage


def merged_native(answers: list[Any], samples: int, prompts: int | None) -> list[Any]:
    """The items of every sample's /generate answer, prompt-major."""
    per_sample = [a if isinstance(a, list) else [a] for a in answers]
    count = prompts or 1
    if any(len(items) != count for items in per_sample):
        raise UpstreamError("a sample's answer does not hold one item per prompt")
    return [per_sample[s][p] for p in range(count) for s in range(samples)]


def merged_openai(answers: list[Any], samples: int) -> dict[str, Any]:
    """Sample 0's OpenAI answer with every sample's choices, renumbered, and the usage of all."""
    if not all(isinstance(a, dict) and isinstance(a.get("choices"), list) for a in answers):
        raise UpstreamError("a sample's answer has no choices")
    merged = dict(answers[0])
    choices = []
    for sample, answer in enumerate(answers):
        for choice in answer["choices"]:
            choice["index"] = renumber(choice.get("index", 0), sample, samples)
            choices.append(choice)
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    usages = [a.get("usage") for a in answers]
    if all(isinstance(u, dict) for u in usages):
        merged["usage"] = merged_usage(usages)
    return merged


def error_message(body: bytes) -> str:
    """A worker's error answer as one line for an SSE error event."""
    return body.decode("utf-8", "replace")[:ERROR_EXCERPT_CHARS]


class Merge:
    """What the samples of one request answered, and when the request is over early: a sample
    refused (a whole error answer), the client went away, or a stream carried an error."""

    def __init__(self, reply: Reply, sampling: Sampling, prompts: int | None) -> None:
        self.reply = reply
        self.native = sampling.endpoint.native
        self.samples = sampling.samples
        self.prompts = prompts
        self.answers: list[bytes | None] = [None] * sampling.samples
        self.content_type: str | None = None
        self.refusal: tuple[int, bytes, str | None] | None = None
        self.gone = False
        self.errored = False
        # Set once the request is over early, to stop waiting for the other samples.
        self.ended = asyncio.Event()

    @property
    def over(self) -> bool:
        return self.refusal is not None or self.gone or self.errored

    def end_early(self) -> None:
        self.ended.set()

    def answered(self, sample: int, status: int, body: bytes, content_type: str | None) -> None:
        if 200 <= status < 300 and self.content_type is None:
            self.content_type = content_type
        if 200 <= status < 300 and self.refusal is None:
            self.answers[sample] = body
        elif self.refusal is None:
            self.refusal = (status, body, content_type)
            self.end_early()

    async def start(self, status: int, headers: Headers) -> None:
        raise NotImplementedError

    async def write(self, sample: int, data: bytes) -> None:
        raise NotImplementedError

    async def finish(self) -> None:
        """Answer the client once every sample answered (or the request ended early)."""
        raise NotImplementedError

    async def fail(self, error: BaseException) -> None:
        """A sample failed for good with ``error``: the client's answer."""
        raise error


class UnaryMerge(Merge):
    """Whole answers, merged into one once all are in."""

    async def finish(self) -> None:
        if self.refusal is not None:
            await self.reply.send(*self.refusal)
            return
        try:
            answers = [orjson.loads(a or b"") for a in self.answers]
        except orjson.JSONDecodeError:
            raise UpstreamError("a sample's answer is not JSON") from None
        if self.native:
            merged: Any = merged_native(answers, self.samples, self.prompts)
        else:
            merged = merged_openai(answers, self.samples)
        await self.reply.send(200, orjson.dumps(merged), self.content_type)


class StreamMerge(Merge):
    """The samples' SSE events relayed as they come, renumbered; their usage chunks are held
    and merged into one before the single ``[DONE]``."""

    def __init__(self, reply: Reply, sampling: Sampling, prompts: int | None) -> None:
        super().__init__(reply, sampling, prompts)
        self.buffers = [b""] * sampling.samples
        self.usage_chunks: dict[int, dict[str, Any]] = {}

    async def start(self, status: int, headers: Headers) -> None:
        """The first sample to stream sends the client its head."""
        if self.reply.started:
            return
        try:
            await self.reply.start(status, headers)
        except ConnectionResetError:
            self.gone = True
            self.end_early()
            raise

    async def write(self, sample: int, data: bytes) -> None:
        if self.over:
            # Another sample ended the request: this one stops as for a client gone.
            raise ConnectionResetError("the request ended")
        buffer = self.buffers[sample] + data
        out = []
        while not self.errored and (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[: end + 2], buffer[end + 2 :]
            rewritten = self.rewrite(sample, event)
            if rewritten is not None:
                out.append(rewritten)
        self.buffers[sample] = buffer
        if out:
            await self.send_events(b"".join(out))

    async def send_events(self, data: bytes) -> None:
        try:
            await self.reply.write(data)
        except ConnectionResetError:
            self.gone = True
            self.end_early()
            raise

    def rewrite(self, sample: int, event: bytes) -> bytes | None:
        """One event as the client gets it (None: held back)."""
        if event.rstrip() == END_EVENT.rstrip():
            return None
        payload = event_payload(event)
        if not isinstance(payload, dict):
            return event
        if "error" in payload:
            self.errored = True
            self.end_early()
            return event
        if self.native:
            payload["index"] = renumber(payload.get("index", 0), sample, self.samples)
        else:
            choices = payload.get("choices")
            if choices == [] and isinstance(payload.get("usage"), dict):
                self.usage_chunks[sample] = payload
                return None
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict):
                    choice["index"] = renumber(choice.get("index", 0), sample, self.samples)
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    async def finish(self) -> None:
        if self.gone:
            raise ConnectionResetError("client closed the connection")
        if self.refusal is not None:
            status, body, content_type = self.refusal
            if not self.reply.started:
                await self.reply.send(status, body, content_type)
                return
            await self.close(sse_error_event(error_message(body), "upstream_error", status))
            return
        tail = b""
        if self.usage_chunks and not self.errored:
            chunks = [self.usage_chunks[s] for s in sorted(self.usage_chunks)]
            usage = merged_usage([c["usage"] for c in chunks])
            tail = b"data: " + orjson.dumps({**chunks[0], "usage": usage}) + b"\n\n"
        await self.close(tail)

    async def fail(self, error: BaseException) -> None:
        if self.gone:
            raise ConnectionResetError("client closed the connection")
        if not self.reply.started or not isinstance(error, RouterError):
            raise error
        await self.close(sse_error_event(error.message, error.error_type, error.status))

    async def close(self, last: bytes) -> None:
        """End the client's stream with ``last`` and the one ``[DONE]``."""
        try:
            await self.reply.write(last + END_EVENT)
            await self.reply.end()
        except ConnectionResetError:
            self.gone = True
            self.end_early()
            raise


class SampleAnswer:
    """One sample's share of the answer: what its request path writes goes to the merge."""

    __slots__ = ("delivered", "merge", "sample", "status")

    def __init__(self, merge: Merge, sample: int) -> None:
        self.merge = merge
        self.sample = sample
        self.status = 0
        self.delivered: int | None = None

    async def send(
        self, status: int, body: bytes, content_type: str | None, headers: Headers = ()
    ) -> None:
        self.status = self.delivered = status
        self.merge.answered(self.sample, status, body, content_type)

    async def start(
        self, status: int, headers: Headers, length: int | None = None, *, own: bool = True
    ) -> None:
        self.status = status
        await self.merge.start(status, headers)

    async def write(self, data: bytes) -> None:
        await self.merge.write(self.sample, data)

    async def end(self) -> None:
        self.delivered = self.status


async def serve_samples(
    sampling: Sampling, reply: Reply, ids: tuple[str, str], run: RunSample
) -> None:
    """Answer a request with ``n > 1`` on ``reply``: its samples served at once by ``run``,
    their answers merged; the first sample that fails for good (or the client leaving) ends
    the others."""
    bodies, prompts = sample_bodies(sampling)
    kind = StreamMerge if sampling.body.get("stream") else UnaryMerge
    merge = kind(reply, sampling, prompts)
    request_id, upstream_id = ids
    tasks = [
        asyncio.create_task(
            run(
                SampleAnswer(merge, s), (f"{request_id}-n{s}", f"{upstream_id}-n{s}"), body, prompts
            )
        )
        for s, body in enumerate(bodies)
    ]
    ended = asyncio.create_task(merge.ended.wait())
    pending: set[asyncio.Task[Any]] = set(tasks)
    try:
        while pending and not merge.over:
            done, pending = await asyncio.wait(
                {*pending, ended}, return_when=asyncio.FIRST_COMPLETED
            )
            pending.discard(ended)
            error = next((e for t in done if t is not ended and (e := failure(t))), None)
            if error is not None:
                await stop(pending)
                pending = set()
                await merge.fail(error)
                return
    finally:
        ended.cancel()
        await stop(pending)
        for task in tasks:
            failure(task)
    await merge.finish()


def failure(task: asyncio.Task) -> BaseException | None:
    """What a finished sample failed with (None: it answered, or it was cancelled)."""
    if not task.done() or task.cancelled():
        return None
    return task.exception()


async def stop(tasks: set[asyncio.Task]) -> None:
    """Cancel the samples still running and wait until their legs were ended and aborted."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
