"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status the
OpenAI clients act on: 400 a bad request (param names the offending field), 401 no valid API key,
404 an unknown model, 429 a full queue (the client retries), 503 warming up or draining, 500 the
engine failed.

The engine's own checks raise ValueError("SamplingParams.top_p=1.5 must be ...") and the like;
`param_of` reads the field's name from such a message, so the 400 names it without a second copy
of the validation here.
"""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from jaxserve.server.http.schemas import ErrorBody, ErrorResponse

_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.([a-z_]+)|^([a-z_][a-z_0-9.\[\]]*)(?:=|\b is\b|:)")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers    # what HTTP says a client of this status needs (WWW-Authenticate, Retry-After)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code,
                              headers=self.headers)


def error_response(status: int, message: str, *, type: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=clip_message(message), type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# An error message quotes the input it is about (a regex, a role, a prompt's start); a client's
# 200 KB regex must not come back as an 800 KB error (its escapes quadruple it). Every run of
# non-space text is cut to ECHO_CHARS, and the whole message to MAX_MESSAGE_CHARS, each cut saying
# what length it had.
ECHO_CHARS = 200
MAX_MESSAGE_CHARS = 2000
_LONG_RUN = re.compile(r"\S{%d,}" % (ECHO_CHARS + 1))


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` itself if short, else its first `limit` characters, "..." and its length."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def clip_message(message: str) -> str:
    message = _LONG_RUN.sub(lambda m: clip(m.group()), message)
    return clip(message, MAX_MESSAGE_CHARS)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """code: for a refusal no request schema can express (jaxserve/refusals.py)."""
    return APIError(400, message, type="invalid_request_error", param=param or param_of(message), code=code)


def refused(e: ValueError, param: str | None = None) -> APIError:
    """The 400 of a ValueError, with the refusal code it carries (jaxserve/refusals.py), if any."""
    return bad_request(str(e), param, getattr(e, "code", None))


def unauthorized(message: str) -> APIError:
    # RFC 9110 15.5.2: a 401 names the scheme to authenticate with (RFC 6750: Bearer)
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": 'Bearer realm="jaxserve"'})


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                    type="invalid_request_error", param="model", code="model_not_found")


# what a 429 asks a client to wait (RFC 6585): a full queue or stream limit frees within a step or
# a request's end, so a second is a retry that may succeed, not one that hammers
RETRY_AFTER_S = 1


def too_many_requests(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code="service_unavailable")


def internal(message: str) -> APIError:
    return APIError(500, message, type="internal_error", code="internal_error")


def not_implemented(message: str) -> APIError:
    return APIError(501, message, type="not_implemented", code="not_implemented")


def param_of(message: str) -> str | None:
    """The field a door's ValueError names at its start (`SamplingParams.top_p=...`,
    `messages[2].role=...`, `cache_salt must be ...`), or None."""
    m = _PARAM_IN_MESSAGE.match(message)
    return (m.group(1) or m.group(2)) if m else None
