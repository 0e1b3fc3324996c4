"""The Response object of one request: its settings echoed as OpenAI echoes them (effective
values: temperature 1.0 when unset), the output items, the status and the usage. One builder for
the non-streamed answer, the streamed events' snapshots and the stored copy, so all three agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.chat_output import ChatMessageOut

from jaxserve.server.http.logprobs import TokenText, chat_logprobs
from jaxserve.server.http.responses_schemas import (FunctionCall, IncompleteDetails, InputTokensDetails, OutputItem,
                                                    OutputMessage, OutputText, OutputTokensDetails, ReasoningItem,
                                                    ReasoningText, ResponseError, ResponseObject, ResponsesRequest,
                                                    ResponseUsage, new_item_id)
from jaxserve.server.http.schemas import TokenLogprob, Usage
from jaxserve.server.sample_deltas import SampleDelta


@dataclass
class AnswerText:
    """The one sample's text, tokens and logprobs as its deltas arrive."""
    logprobs_k: int | None                 # top alternatives per token; None: no logprobs asked
    text_of: TokenText
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None    # the stop string or token id it ended at

    def add(self, d: SampleDelta) -> list[TokenLogprob]:
        """Take a delta; returns its tokens' logprobs (empty when none were asked)."""
        self.text += d.text
        self.token_ids += d.token_ids
        new = []
        if self.logprobs_k is not None and d.logprobs is not None:
            new = chat_logprobs(d.token_ids, d.logprobs, self.logprobs_k, self.text_of).content
            self.logprobs += new
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        return new

    @property
    def cut_short(self) -> bool:
        """The answer ended at max_output_tokens (or the model's context), not by itself."""
        return self.finish_reason == "length"


async def collect_answer(run, answer: AnswerText) -> AnswerText:
    """The run's one sample into `answer`, to its end; the engine's errors as HTTP errors."""
    from jaxserve.server.http.openai_front import engine_error

    try:
        async for cd in run.deltas():
            answer.add(cd.delta)
    except Exception as e:
        err = engine_error(e)
        if err is None:
            raise
        raise err from e
    return answer


@dataclass
class ResponseBuilder:
    req: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: new_item_id("msg"))
    reasoning_id: str = field(default_factory=lambda: new_item_id("rs"))

    def snapshot(self, *, status: str = "in_progress", output: list | None = None, usage: Usage | None = None,
                 error: ResponseError | None = None) -> ResponseObject:
        r = self.req
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"},
                "verbosity": "medium"}
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model, output=output or [],
            completed_at=int(time.time()) if status in ("completed", "incomplete") else None, error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=r.instructions, max_output_tokens=r.max_output_tokens,
            parallel_tool_calls=r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            previous_response_id=r.previous_response_id, store=r.store is not False,
            temperature=r.temperature if r.temperature is not None else 1.0,
            top_p=r.top_p if r.top_p is not None else 1.0, top_logprobs=r.top_logprobs or 0, text=text,
            presence_penalty=r.presence_penalty or 0.0, frequency_penalty=r.frequency_penalty or 0.0,
            max_tool_calls=r.max_tool_calls,
            tool_choice=r.tool_choice if r.tool_choice is not None else "auto",
            tools=[echoed_tool(t) for t in r.tools or []],
            truncation=r.truncation or "disabled", usage=_usage(usage) if usage is not None else None,
            user=r.user, safety_identifier=r.safety_identifier, prompt_cache_key=r.prompt_cache_key,
            metadata=dict(r.metadata or {}))

    def message(self, text: str, logprobs: list[TokenLogprob], *, status: str) -> OutputMessage:
        return OutputMessage(id=self.message_id, status=status, content=[OutputText(text=text, logprobs=logprobs)])

    def reasoning(self, text: str, *, status: str) -> ReasoningItem:
        return ReasoningItem(id=self.reasoning_id, status=status, content=[ReasoningText(text=text)])

    def items(self, out: ChatMessageOut, answer: AnswerText) -> list[OutputItem]:
        """A whole answer's output items: its reasoning, its text (also when empty, if there is
        nothing else), its function calls, in that order (the order chat_output parses them in,
        so a stream's items come in it too)."""
        status = item_status(answer)
        items: list[OutputItem] = []
        if out.reasoning:
            items.append(self.reasoning(out.reasoning, status=status))
        if out.content or not (items or out.tool_calls):
            items.append(self.message(out.content or "", list(answer.logprobs), status=status))
        items += [FunctionCall(id=new_item_id("fc"), call_id=c.id, name=c.name, arguments=c.arguments, status=status)
                  for c in out.tool_calls]
        return items

    def finished(self, output: list[OutputItem], answer: AnswerText, usage: Usage) -> ResponseObject:
        return self.snapshot(status="incomplete" if answer.cut_short else "completed", output=output, usage=usage)


def echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's tool as the Response echoes it: a function tool with every field of OpenAI's
    FunctionTool (description, parameters and strict null when unset); others as they came (the
    request refuses them before a Response is built)."""
    if tool.get("type") != "function":
        return dict(tool)
    return {"type": "function", "name": tool.get("name"), "description": None, "parameters": None, "strict": None,
            **tool}


def as_chat_message(output: list[OutputItem]) -> dict[str, Any]:
    """A response's output as the assistant message of the stored conversation (in the request
    messages' shape: calls with their arguments' JSON text); the reasoning is not kept, as chat
    templates drop an earlier turn's reasoning."""
    text = "".join(p.text for item in output if isinstance(item, OutputMessage) for p in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in output if isinstance(item, FunctionCall)]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def _usage(u: Usage) -> ResponseUsage:
    return ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=u.prompt_tokens_details.cached_tokens),
                         output_tokens_details=OutputTokensDetails())


def item_status(answer: AnswerText) -> str:
    return "incomplete" if answer.cut_short else "completed"
