"""Running a handler's work only while its client is still connected.

Starlette cancels a streaming response's body when the client disconnects, but an ordinary
handler runs to its end: a client that gives up on a long non-streamed completion would leave its
request decoding. `unless_disconnected` races the work against the connection's `http.disconnect`
message and cancels it (which closes the engine streams, aborting their requests) when the client
leaves first.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Awaitable, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready; nobody reads a response."""


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:   # also when this handler is cancelled (server shutdown): the work goes with it
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task in done:
        return task.result()
    raise ClientDisconnected()
