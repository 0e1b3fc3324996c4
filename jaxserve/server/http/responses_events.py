"""A streamed response's server-sent events, as the openai client's `responses.stream(...)` helper
reads them: `event: <type>` and `data: {"type", "sequence_number", ...}` (numbered from 0).

    response.created, response.in_progress                      (the response, status in_progress)
    per output item, when its first piece comes (an empty answer: an empty message at the end):
      response.output_item.added, response.content_part.added (not for a call)
      response.reasoning_text.delta | response.output_text.delta (with its logprobs)
        | response.function_call_arguments.delta ...
      response.reasoning_text.done | response.output_text.done | response.function_call_arguments.done,
      response.content_part.done (not for a call), response.output_item.done
    response.completed | response.incomplete                    (the whole response, as the
                                                                 non-streamed answer has it)

An error after the 200 went out is an `error` event followed by `response.failed`. There is no
`[DONE]` line: the Responses API ends the body with the last event.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable, Iterator

from pydantic import BaseModel

from jaxserve.chat_output import ChatDelta, ChatOutputParser
from jaxserve.server.http import errors
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.responses_output import AnswerText, ResponseBuilder, item_status
from jaxserve.server.http.responses_schemas import (FunctionCall, OutputItem, OutputMessage, OutputText, ReasoningItem,
                                                    ReasoningText, ResponseError, ResponseObject, new_item_id)
from jaxserve.server.http.schemas import TokenLogprob

log = logging.getLogger(__name__)


class EventNumbers:
    """Formats events, numbering them in the order they are sent."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, type: str, **payload: Any) -> str:
        data = {"type": type, "sequence_number": self.next,
                **{k: v.model_dump(mode="json", by_alias=True) if isinstance(v, BaseModel) else v
                   for k, v in payload.items()}}
        self.next += 1
        return f"event: {type}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class OutputStream:
    """The output items as a stream's deltas open, grow and close them; `items` in output_index
    order is the final response's output. The reasoning closes when anything else begins (it comes
    first), a call when the next call begins, the rest at the end."""

    def __init__(self, builder: ResponseBuilder, answer: AnswerText, event: EventNumbers) -> None:
        self.builder, self.answer, self.event = builder, answer, event
        self.items: list[OutputItem] = []
        self._open: dict[int, str] = {}      # output index -> text or arguments so far
        self._reasoning = self._message = None   # their output indexes once opened
        self._calls: dict[int, int] = {}         # the parser's call index -> output index

    def delta(self, d: ChatDelta, logprobs: list[TokenLogprob]) -> Iterator[str]:
        if d.reasoning:
            if self._reasoning is None:
                self._reasoning = yield from self._add(self.builder.reasoning("", status="in_progress"),
                                                       ReasoningText(text=""))
            yield from self._grow(self._reasoning, "response.reasoning_text.delta", d.reasoning, content_index=0)
        if d.content or logprobs:
            yield from self._close_reasoning()
            if self._message is None:
                self._message = yield from self._add(self.builder.message("", [], status="in_progress"),
                                                     OutputText(text="", logprobs=[]))
            yield from self._grow(self._message, "response.output_text.delta", d.content, content_index=0,
                                  logprobs=[lp.model_dump(mode="json") for lp in logprobs])
        for c in d.tool_calls:
            yield from self._close_reasoning()
            if c.id is not None:   # a call's header: the one before it is complete
                for earlier in self._calls.values():
                    yield from self._close(earlier)
                self._calls[c.index] = yield from self._add(FunctionCall(
                    id=new_item_id("fc"), call_id=c.id, name=c.name or "", arguments="", status="in_progress"))
            if c.arguments:
                yield from self._grow(self._calls[c.index], "response.function_call_arguments.delta", c.arguments)

    def finish(self) -> Iterator[str]:
        if not self.items:   # an empty answer is an empty message, as the whole answer's items have it
            self._message = yield from self._add(self.builder.message("", [], status="in_progress"),
                                                 OutputText(text="", logprobs=[]))
        for i in sorted(self._open):
            yield from self._close(i)

    def _add(self, item: OutputItem, part=None) -> Iterator[str]:
        index = len(self.items)
        self.items.append(item)
        self._open[index] = ""
        yield self.event("response.output_item.added", output_index=index, item=item)
        if part is not None:
            yield self.event("response.content_part.added", item_id=item.id, output_index=index, content_index=0,
                             part=part)
        return index

    def _grow(self, index: int, type: str, delta: str, **fields) -> Iterator[str]:
        self._open[index] += delta
        yield self.event(type, item_id=self.items[index].id, output_index=index, delta=delta, **fields)

    def _close_reasoning(self) -> Iterator[str]:
        if self._reasoning is not None and self._reasoning in self._open:
            yield from self._close(self._reasoning)

    def _close(self, index: int) -> Iterator[str]:
        if index not in self._open:
            return
        text, status = self._open.pop(index), item_status(self.answer)
        item, b, at = self.items[index], self.builder, dict(item_id=self.items[index].id, output_index=index)
        if isinstance(item, ReasoningItem):
            done = b.reasoning(text, status=status)
            yield self.event("response.reasoning_text.done", content_index=0, text=text, **at)
            yield self.event("response.content_part.done", content_index=0, part=done.content[0], **at)
        elif isinstance(item, OutputMessage):
            done = b.message(text, list(self.answer.logprobs), status=status)
            part = done.content[0]
            yield self.event("response.output_text.done", content_index=0, text=text,
                             logprobs=[lp.model_dump(mode="json") for lp in part.logprobs or []], **at)
            yield self.event("response.content_part.done", content_index=0, part=part, **at)
        else:
            done = item.model_copy(update={"arguments": text, "status": status})
            yield self.event("response.function_call_arguments.done", arguments=text, **at)
        self.items[index] = done
        yield self.event("response.output_item.done", output_index=index, item=done)


async def response_events(run: EngineRun, builder: ResponseBuilder, answer: AnswerText, *,
                          parser: ChatOutputParser | None,
                          finish: Callable[[list[OutputItem], AnswerText], ResponseObject],
                          error_of: Callable[[BaseException], errors.APIError | None],
                          close: Callable[[], Any]) -> AsyncIterator[str]:
    """`parser` splits reasoning and calls from the text (None: it is all text);
    `finish(items, answer)` is the final response (and stores it); `close()` ends the run and
    releases the request's stream slot, also when the client leaves mid-stream (this generator is
    then cancelled at its current await)."""
    event = EventNumbers()
    out = OutputStream(builder, answer, event)
    try:
        yield event("response.created", response=builder.snapshot())
        yield event("response.in_progress", response=builder.snapshot())
        async for cd in run.deltas():
            logprobs = answer.add(cd.delta)
            d = parser.feed(cd.delta.text) if parser is not None else ChatDelta(content=cd.delta.text)
            for e in out.delta(d, logprobs):
                yield e
        if parser is not None:
            for e in out.delta(parser.finish(), []):
                yield e
        for e in out.finish():
            yield e
        final = finish(out.items, answer)
        yield event("response.incomplete" if final.status == "incomplete" else "response.completed", response=final)
    except Exception as e:   # after the 200 went out: the error is an event of its own
        err = error_of(e)
        if err is None:
            log.exception("streaming a response failed")
            err = errors.internal(f"{type(e).__name__}: {e}")
        code = err.code or ("invalid_prompt" if err.status == 400 else "server_error")
        yield event("error", code=code, message=err.message, param=err.param)
        yield event("response.failed", response=builder.snapshot(
            status="failed", error=ResponseError(code=code, message=err.message)))
    finally:
        await close()
