"""Bounds on a request body, checked before and while it is read.

Size: as gRPC refuses a message beyond --max-message-bytes unread, the HTTP front answers 413 to a
body beyond the same bound instead of holding it in memory and parsing it (a Content-Length says
so at once; a chunked body is counted as it arrives).

Time: a client that sends its body slowly (or stops half-way) holds a connection and a task; the
whole body must arrive within --http-body-timeout seconds of the request's headers, else 408 and
the connection closes. (Slow headers are the listener's: http/slow_headers.py.)
"""

from __future__ import annotations

import asyncio
import time

from jaxserve.server.http import errors


def too_large(limit: int) -> errors.APIError:
    return errors.APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                f"(--max-message-bytes)", type="invalid_request_error",
                           code="request_too_large")


def too_slow(timeout_s: float) -> errors.APIError:
    return errors.APIError(408, f"the request body did not arrive within {timeout_s:g} s (--http-body-timeout)",
                           type="invalid_request_error", code="request_timeout")


class BodyLimit:
    """ASGI middleware: 413 in OpenAI's error shape for a body over `max_bytes`, 408 for one that
    takes longer than `timeout_s` (either bound None: none)."""

    def __init__(self, app, max_bytes: int | None = None, timeout_s: float | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.max_bytes is not None:
            for name, value in scope.get("headers", ()):
                if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                    return await too_large(self.max_bytes).response()(scope, receive, send)
        deadline = time.monotonic() + self.timeout_s if self.timeout_s is not None else None
        seen = 0
        body_done = False    # after the body, receive() only waits for a disconnect: no deadline then
        answered = False     # our 413/408 went out: the app's answer goes nowhere

        async def refuse(err: errors.APIError):
            nonlocal answered
            response = err.response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            answered = True
            return {"type": "http.disconnect"}   # the app stops reading, as if the client left

        async def counted():
            nonlocal seen, body_done
            if answered:
                return {"type": "http.disconnect"}
            if deadline is not None and not body_done:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return await refuse(too_slow(self.timeout_s))
            else:
                message = await receive()
            if message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if self.max_bytes is not None and seen > self.max_bytes:
                    return await refuse(too_large(self.max_bytes))
            return message

        async def guarded_send(message):
            if not answered:
                await send(message)

        return await self.app(scope, counted, guarded_send)
