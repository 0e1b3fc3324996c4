"""Errors in Anthropic's shape on the Messages routes, `{"type": "error", "error": {"type", "message"}}`,
with Anthropic's error types and statuses:

    400 invalid_request_error   401 authentication_error   403 permission_error
    404 not_found_error         408 timeout_error          413 request_too_large
    529 overloaded_error        (the server's 429: its streams or its queue are full;
                                 and 503, warming up or draining, keeps its status)
    500 api_error               (and any other 5xx)

Every error of the server is made in OpenAI's shape (http/errors.py: the handlers, FastAPI's
validation, the body limits); `AnthropicErrors`, an ASGI middleware outside all of them, rewrites
the error answers of /v1/messages and the paths below it, and answers a bug there itself (a 500,
logged with its traceback, none sent). A refusal's code (jaxserve/refusals.py) stays as `error.code`,
jaxserve's addition to Anthropic's object, as the OpenAI-shaped errors carry it.
"""

from __future__ import annotations

import json
import logging

from jaxserve.server.http import errors

log = logging.getLogger("jaxserve.server.http")

MESSAGES_PATH = "/v1/messages"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large",
          503: "overloaded_error", 529: "overloaded_error"}
_STATUS = {429: 529}     # a full server is Anthropic's overload, not a client's rate limit


def anthropic_status(status: int) -> int:
    return _STATUS.get(status, status)


def anthropic_type(status: int) -> str:
    status = anthropic_status(status)
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_body(status: int, message: str, code: str | None = None) -> dict:
    error = {"type": anthropic_type(status), "message": errors.clip_message(message)}
    if code is not None:
        error["code"] = code
    return {"type": "error", "error": error}


def error_event_body(err: errors.APIError) -> str:
    """An error event's data: the APIError as Anthropic's error object (JSON text)."""
    return json.dumps(anthropic_body(err.status, err.message, err.code if err.status == 400 else None),
                      separators=(",", ":"))


def _rewritten(status: int, body: bytes) -> tuple[int, bytes]:
    """An OpenAI-shaped error answer as Anthropic's (anything else as it came)."""
    try:
        error = json.loads(body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return status, body
    code = error.get("code") if status == 400 else None   # a refusal's code; the rest are OpenAI's names
    return anthropic_status(status), json.dumps(anthropic_body(status, message, code)).encode()


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class AnthropicErrors:
    """ASGI middleware: the error answers of the Messages paths in Anthropic's shape (above)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            return await self.app(scope, receive, send)
        held: dict | None = None      # an error's response start, sent with its rewritten body
        body: list[bytes] = []
        started = False

        async def rewriting_send(message):
            nonlocal held, started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                body.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                status, new = _rewritten(held["status"], b"".join(body))
                headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
                await send({**held, "status": status, "headers": headers + [(b"content-length", b"%d" % len(new))]})
                await send({"type": "http.response.body", "body": new})
                return
            await send(message)

        try:
            await self.app(scope, receive, rewriting_send)
        except Exception as e:
            if started:
                raise
            # a bug: logged with its traceback here, never sent (the client gets Anthropic's shape)
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
            new = json.dumps(anthropic_body(500, f"internal error ({type(e).__name__})")).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(new))]})
            await send({"type": "http.response.body", "body": new})
