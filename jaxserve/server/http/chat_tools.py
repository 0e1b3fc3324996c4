"""The chat route's tools and reasoning: a request's tools, tool_choice and parallel_tool_calls
-> its ToolPlan (tool_parsers/plan.py), and a parsed answer (chat_output.py) -> the response's
message or a streamed chunk's delta, in OpenAI's shapes."""

from __future__ import annotations

from jaxserve.chat_output import ChatDelta, ChatMessageOut
from jaxserve.server.http.errors import bad_request
from jaxserve.server.http.schemas import (AssistantMessage, ChatCompletionRequest, DeltaFunctionCall, DeltaMessage,
                                          DeltaToolCall, FunctionCall, ToolCallOut)
from jaxserve.tool_parsers.plan import (ToolChoice, ToolError, ToolPlan, function_tools, plan_tools,
                                        resolve_tool_parser)


def model_type_of(engine) -> str | None:
    """The served checkpoint's HF model_type (None for a custom model): the default parser's hint."""
    return getattr(getattr(engine.runner, "model_config", None), "model_type", None)


def chat_tool_plan(req: ChatCompletionRequest, engine, *, parser: str | None) -> ToolPlan:
    """400 (naming tools or tool_choice) for what plan_tools refuses, and for a constrained call
    beside response_format / structured_outputs (two grammars for one answer)."""
    tok = engine.tokenizer
    try:
        tools = function_tools([t.model_dump(exclude_none=True) for t in req.tools or ()])
        choice = ToolChoice.from_openai(req.tool_choice)
        name = None
        if tools and (choice is None or choice.mode != "none"):
            name = resolve_tool_parser(parser, tok, model_type_of(engine))
        plan = plan_tools(tools, choice, parallel_tool_calls=req.parallel_tool_calls, parser=name, tokenizer=tok)
    except ToolError as e:
        raise bad_request(str(e), e.param, e.code) from None
    other = (req.response_format is not None and req.response_format.type != "text") or req.structured_outputs
    if plan.structured_outputs is not None and other:
        raise bad_request("tool_choice 'required' or a named function constrains the answer to tool calls; it "
                          "cannot be combined with response_format or structured_outputs", "tool_choice")
    return plan


def assistant_message(out: ChatMessageOut, *, reasoning_parsed: bool) -> AssistantMessage:
    calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in out.tool_calls]
    reasoning = out.reasoning if reasoning_parsed else None
    return AssistantMessage(content=out.content, reasoning=reasoning, reasoning_content=reasoning,
                            tool_calls=calls or None)


def delta_message(d: ChatDelta) -> DeltaMessage:
    """A chunk's delta: content None beside reasoning or calls (OpenAI's null), else the text."""
    calls = [DeltaToolCall(index=c.index, id=c.id, type="function" if c.id is not None else None,
                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
             for c in d.tool_calls]
    content = d.content if d.content or not (d.reasoning or calls) else None
    return DeltaMessage(content=content, reasoning=d.reasoning or None, reasoning_content=d.reasoning or None,
                        tool_calls=calls or None)


def joined(a: ChatDelta, b: ChatDelta) -> ChatDelta:
    return ChatDelta(a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls)
