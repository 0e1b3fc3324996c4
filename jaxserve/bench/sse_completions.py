"""The server-sent events of a streamed OpenAI `/v1/completions` answer, read line by line.

A completion stream is `data: {json}` events separated by blank lines and closed by `data:
[DONE]`. Each chunk's `choices[0].text` may hold several tokens (a server sends what it has
decoded), so the text says nothing about token counts: the count is the `usage` object, sent on
the last chunk with `stream_options.include_usage` (jaxserve and vLLM send it alone with
`choices: []`, llama.cpp's llama-server on the chunk with `finish_reason`). jaxserve,
llama-server and vLLM send an error after the 200 as an event `{"error": {...}}`.

`completion_events` turns the lines into `CompletionEvent`s and raises `StreamFailed` on an
error event, a line that is not JSON, or a body that ends before `[DONE]` (a server that died
mid-answer): such a request never looks finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterable, AsyncIterator


class StreamFailed(RuntimeError):
    """The stream broke: its message is the request's failure reason in the report."""


@dataclass(frozen=True, slots=True)
class CompletionEvent:
    text: str                             # choices[0].text; "" for a usage-only or a finish chunk
    finish_reason: str | None = None
    completion_tokens: int | None = None  # usage.completion_tokens, on the chunk that carries usage


def _event(payload: str) -> CompletionEvent:
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as e:
        raise StreamFailed(f"a stream event is not JSON: {payload[:200]!r}") from e
    if not isinstance(data, dict):
        raise StreamFailed(f"a stream event is not a JSON object: {payload[:200]!r}")
    if data.get("error") is not None:
        err = data["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        raise StreamFailed(f"the server sent an error event: {message}")
    choices = data.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return CompletionEvent(text=first.get("text") or "", finish_reason=first.get("finish_reason"),
                           completion_tokens=int(tokens) if tokens is not None else None)


async def completion_events(lines: AsyncIterable[str]) -> AsyncIterator[CompletionEvent]:
    """The events of one streamed completion, from its body's lines (without line endings).
    Comments (`: ping`) and fields other than `data` are skipped; an `event: error` field marks
    its event's data as an error whatever the data says."""
    data: list[str] = []
    is_error = False
    async for line in lines:
        if line == "":
            if data:
                payload = "\n".join(data)
                data, error_field = [], is_error
                is_error = False
                if payload.strip() == "[DONE]":
                    return
                if error_field:
                    raise StreamFailed(f"the server sent an error event: {payload[:500]}")
                yield _event(payload)
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "event" and value.strip() == "error":
            is_error = True
    if data and "\n".join(data).strip() == "[DONE]":   # a last event without its blank line
        return
    raise StreamFailed("the server closed the stream before [DONE]")
