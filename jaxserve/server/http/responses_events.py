"""A streamed response's server-sent events, as the openai client's `responses.stream(...)` helper
reads them: `event: <type>` and `data: {"type", "sequence_number", ...}` (numbered from 0).

    response.created, response.in_progress                      (the response, status in_progress)
    response.output_item.added, response.content_part.added     (when the first text comes, or at
                                                                 the end for an empty answer)
    response.output_text.delta ...                              (each new text, with its logprobs)
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed | response.incomplete                    (the whole response, as the
                                                                 non-streamed answer has it)

An error after the 200 went out is an `error` event followed by `response.failed`. There is no
`[DONE]` line: the Responses API ends the body with the last event.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel

from jaxserve.server.http import errors
from jaxserve.server.http.engine_run import EngineRun
from jaxserve.server.http.responses_output import AnswerText, ResponseBuilder, item_status
from jaxserve.server.http.responses_schemas import ResponseError, ResponseObject

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


async def response_events(run: EngineRun, builder: ResponseBuilder, answer: AnswerText, *,
                          finish: Callable[[AnswerText], ResponseObject],
                          error_of: Callable[[BaseException], errors.APIError | None],
                          close: Callable[[], Any]) -> AsyncIterator[str]:
    """`finish(answer)` is the final response (and stores it); `close()` ends the run and releases
    the request's stream slot, also when the client leaves mid-stream (this generator is then
    cancelled at its current await)."""
    event = EventNumbers()
    msg_id = builder.message_id
    opened = False

    def open_message():
        yield event("response.output_item.added", output_index=0,
                    item=builder.message(AnswerText(answer.logprobs_k, answer.text_of), status="in_progress"))
        yield event("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                    part=builder.text_part(AnswerText(answer.logprobs_k, answer.text_of)))

    try:
        yield event("response.created", response=builder.snapshot())
        yield event("response.in_progress", response=builder.snapshot())
        async for cd in run.deltas():
            logprobs = answer.add(cd.delta)
            if not cd.delta.text and not logprobs:
                continue
            if not opened:
                opened = True
                for e in open_message():
                    yield e
            yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                        delta=cd.delta.text, logprobs=[lp.model_dump(mode="json") for lp in logprobs])
        if not opened:
            for e in open_message():
                yield e
        final = finish(answer)
        part = builder.text_part(answer)
        yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=answer.text,
                    logprobs=[lp.model_dump(mode="json") for lp in answer.logprobs])
        yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
        yield event("response.output_item.done", output_index=0, item=builder.message(answer, status=item_status(answer)))
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
