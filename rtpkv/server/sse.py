"""Server-sent events, and cancelling work when the client goes away.

Starlette notices a disconnect only when the next chunk fails to send (or not at all, under
some ASGI versions); a request still waiting in the queue sends nothing. These helpers watch the
connection itself, so a disconnect cancels the request's stream at once: its engine request is
aborted and leaves within one engine step, its blocks released.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` whose body iterator is cancelled and closed when the client
    disconnects, and closed in every other case too (so its cleanup always runs)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], **kwargs: Any):
        super().__init__(content, headers={"Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"}, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def watch() -> None:
                    await _wait_for_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                try:
                    await self.stream_response(send)
                except OSError:  # the client went away while a chunk was being sent
                    pass
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""
