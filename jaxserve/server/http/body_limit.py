"""A bound on a request body, checked before it is read: as gRPC refuses a message beyond
--max-message-bytes unread, the HTTP front answers 413 to a body beyond the same bound instead of
holding it in memory and parsing it (a Content-Length says so at once; a chunked body is counted
as it arrives)."""

from __future__ import annotations

from jaxserve.server.http import errors


def too_large(limit: int) -> errors.APIError:
    return errors.APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                f"(--max-message-bytes)", type="invalid_request_error",
                           code="request_too_large")


class BodyLimit:
    """ASGI middleware: 413 in OpenAI's error shape for a body over `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await too_large(self.max_bytes).response()(scope, receive, send)
        seen = 0
        answered = False     # a chunked body crossed the limit: our 413 went out, the app's answer goes nowhere

        async def counted():
            nonlocal seen, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    await too_large(self.max_bytes).response()(scope, receive, send)
                    answered = True
                    return {"type": "http.disconnect"}   # the app stops reading, as if the client left
            return message

        async def guarded_send(message):
            if not answered:
                await send(message)

        return await self.app(scope, counted, guarded_send)
