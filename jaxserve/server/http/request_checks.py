"""Checks every request body gets before its fields are validated (schemas._Request runs them on
each request model's raw input).

- A lone surrogate (U+D800..U+DFFF alone: `"\\ud800"` in JSON, or the bytes ED A0 80, which
  Python's JSON decoder lets through) is no Unicode text: the tokenizer and the JSON encoder of the
  answer would fail on it, so it is a 400 naming where it is, not a 500.
- Unknown fields are a 400 (the models' extra="forbid"; a model with extra="ignore" ignores only
  null or empty ones), unless the server runs with
  --lenient-api: they are then dropped with a warning that names them (`lenient_api`, set per
  request by the app's middleware, so two apps in one process can differ).
"""

from __future__ import annotations

import contextvars
import logging
import re
from typing import Any

from pydantic_core import PydanticCustomError

log = logging.getLogger("jaxserve.server.http")

lenient_api: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxserve_lenient_api", default=False)

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(data: Any) -> str | None:
    """Where in a JSON value (dicts, lists, strings) a string holds a lone surrogate, as
    `messages[1].content`; None if nowhere. Iterative: a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                key_path = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _SURROGATE.search(key):
                    return path or "body"
                stack.append((key_path, item))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def check_request_body(model: type, data: Any) -> Any:
    """A request model's raw input, checked (lone surrogates) and, with --lenient-api, without the
    fields the model does not have. Raises pydantic's own error kind, so the 400 says where."""
    if not isinstance(data, dict):
        return data
    where = lone_surrogate_path(data)
    if where is not None:
        raise PydanticCustomError("lone_surrogate", "{where}: the text holds a lone UTF-16 surrogate "
                                  "(U+D800..U+DFFF), which is not valid Unicode", {"where": where})
    extra = model.model_config.get("extra")
    known = set()
    for name, info in model.model_fields.items():
        known.update((name, info.alias or name))
    if extra == "ignore" and not lenient_api.get():
        # a model that ignores extras (a chat message: clients send back the assistant message
        # they got, with refusal, audio, annotations as null) ignores only empty ones; a value
        # would be silently dropped, so it is refused
        given = sorted(str(k) for k, v in data.items() if k not in known and v not in (None, "", [], {}))
        if given:
            raise PydanticCustomError("extra_forbidden", "{fields}: not a field this server takes (it ignores "
                                      "such fields only when null or empty)", {"fields": ", ".join(given)})
    if lenient_api.get() and extra in ("forbid", "ignore"):
        unknown = sorted(k for k in data if k not in known)
        if unknown:
            log.warning("ignoring unknown field(s) %s of %s (--lenient-api)", ", ".join(map(str, unknown)),
                        model.__name__)
            data = {k: v for k, v in data.items() if k in known}
    return data


class LenientAPI:
    """ASGI middleware of --lenient-api: the requests it passes drop unknown fields (logged)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        token = lenient_api.set(True)
        try:
            return await self.app(scope, receive, send)
        finally:
            lenient_api.reset(token)
