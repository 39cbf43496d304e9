"""Running several items of one request together: merged progress, first error wins."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from pd_worker.errors import WorkerError
from pd_worker.requests import GenItem, Progress

Generate = Callable[[GenItem], AsyncIterator[Progress]]
_END = object()


async def merged(generate: Generate, items: list[GenItem]) -> AsyncIterator[tuple[int, Progress]]:
    """Yield ``(index, progress)`` of all items as they come; a failing item raises its error."""
    if len(items) == 1:
        async for progress in generate(items[0]):
            yield 0, progress
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(index: int, item: GenItem) -> None:
        try:
            async for progress in generate(item):
                queue.put_nowait((index, progress))
        except WorkerError as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.create_task(pump(i, item)) for i, item in enumerate(items)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is _END:
                remaining -= 1
            elif isinstance(entry, WorkerError):
                raise entry
            else:
                yield entry
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def final_results(generate: Generate, items: list[GenItem]) -> list[Progress]:
    """The final progress of every item, in item order."""
    results: list[Progress] = [Progress() for _ in items]
    async for index, progress in merged(generate, items):
        results[index] = progress
    return results
