"""A streamed message's server-sent events, as Anthropic sends them and the `anthropic` client's
`messages.stream(...)` helper reads them (`event: <type>` and `data: {"type", ...}`):

    message_start                 (the message, no content yet, the input tokens)
    ping
    per content block, one open at a time, in the order the answer's pieces come:
      content_block_start         (thinking, text, or tool_use with its id, name and input {})
      content_block_delta ...     (thinking_delta | text_delta | input_json_delta)
      content_block_stop
    message_delta                 (stop_reason, stop_sequence, the usage)
    message_stop

An error after the 200 went out is an `error` event (Anthropic's error object), and the stream
ends there.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable, Iterator

from pydantic import BaseModel

from jaxserve.chat_output import ChatDelta, ChatOutputParser
from jaxserve.server.http import errors
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.messages_errors import error_event_body
from jaxserve.server.http.messages_output import message, stop_of
from jaxserve.server.http.messages_schemas import StopReason, TextBlock, ThinkingBlock, ToolUseBlock, new_message_id

log = logging.getLogger(__name__)


def sse(type: str, **payload: Any) -> str:
    data = {"type": type, **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v
                             for k, v in payload.items()}}
    return f"event: {type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


_DELTA = {"thinking": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
          "tool_use": ("input_json_delta", "partial_json")}


class BlockStream:
    """The content blocks as the answer's deltas open, grow and close them. A block closes when
    another begins (Anthropic's streams have one open at a time): the thinking comes first, then
    text and calls as the model writes them."""

    def __init__(self) -> None:
        self.count = 0
        self._open: str | None = None      # the open block's kind
        self._calls: set[int] = set()      # the parser's call indexes already opened

    def delta(self, d: ChatDelta) -> Iterator[str]:
        if d.reasoning:
            yield from self._grow("thinking", d.reasoning, ThinkingBlock(thinking=""))
        if d.content:
            yield from self._grow("text", d.content, TextBlock(text=""))
        for c in d.tool_calls:
            if c.id is not None and c.index not in self._calls:   # a call's header: a block of its own
                self._calls.add(c.index)
                yield from self.close()
                yield from self._start("tool_use", ToolUseBlock(id=new_message_id("toolu"), name=c.name or "",
                                                                input={}))
            if c.arguments:
                yield from self._grow("tool_use", c.arguments, None)

    def close(self) -> Iterator[str]:
        if self._open is not None:
            self._open = None
            yield sse("content_block_stop", index=self.count - 1)

    def _start(self, kind: str, block: BaseModel) -> Iterator[str]:
        self._open = kind
        self.count += 1
        yield sse("content_block_start", index=self.count - 1, content_block=block)

    def _grow(self, kind: str, piece: str, empty: BaseModel | None) -> Iterator[str]:
        if self._open != kind:
            if empty is None:      # arguments whose call never opened: nothing to add them to
                return
            yield from self.close()
            yield from self._start(kind, empty)
        delta, key = _DELTA[kind]
        yield sse("content_block_delta", index=self.count - 1, delta={"type": delta, key: piece})


async def message_events(run: EngineRun, message_id: str, model: str, *, parser: ChatOutputParser | None,
                         stop_sequences: list[str] | None,
                         error_of: Callable[[BaseException], errors.APIError | None],
                         close: Callable[[], Any]) -> AsyncIterator[str]:
    """`parser` splits thinking and calls from the text (None: it is all text); `close()` ends the
    run and releases the request's stream slot, also when the client leaves mid-stream (this
    generator is then cancelled at its current await)."""
    blocks = BlockStream()
    try:
        yield sse("message_start", message=message(message_id, model, [], run.usage()))
        yield sse("ping")
        finish = stop_reason = None
        async for cd in run.deltas():
            d = parser.feed(cd.delta.text) if parser is not None else ChatDelta(content=cd.delta.text)
            for e in blocks.delta(d):
                yield e
            if cd.delta.finish_reason is not None:
                finish, stop_reason = cd.delta.finish_reason, cd.delta.stop_reason
        if finish == "abort":
            raise aborted()
        if parser is not None:
            for e in blocks.delta(parser.finish()):
                yield e
        for e in blocks.close():
            yield e
        stop: tuple[StopReason, str | None] = stop_of(finish, stop_reason, parser is not None and parser.called,
                                                      stop_sequences)
        usage = message(message_id, model, [], run.usage()).usage
        yield sse("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]}, usage=usage)
        yield sse("message_stop")
    except Exception as e:   # after the 200 went out: the error is an event of its own
        err = error_of(e)
        if err is None:
            log.exception("streaming a message failed")
            err = errors.internal(f"{type(e).__name__}: {e}")
        yield f"event: error\ndata: {error_event_body(err)}\n\n"
    finally:
        await close()


def aborted() -> errors.APIError:
    """A request the engine aborted before it finished (the server's shutdown grace ran out, or an
    abort by its id): Anthropic's answer has no stop_reason for it, so it is an error."""
    return errors.unavailable("the request was aborted before it finished (the server is shutting down, or it was "
                              "aborted by its id)")
