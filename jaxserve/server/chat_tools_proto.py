"""The gRPC Chat's tools: its Tool / ToolChoice messages -> a ToolPlan (tool_parsers/plan.py),
and a sample's whole text -> the calls, content and reasoning of its Complete message. Chunks
stream the raw text; the split comes once, on the Complete."""

from __future__ import annotations

import json

from jaxserve.chat_output import ChatOutputSpec, chat_finish_reason
from jaxserve.proto import generation_pb2 as pb
from jaxserve.tool_parsers.plan import (FunctionTool, ToolChoice, ToolError, ToolPlan, function_tools, plan_tools,
                                        resolve_tool_parser)


def tool_plan_from_proto(chat: pb.Chat, engine, *, parser: str | None) -> ToolPlan:
    """ValueError (INVALID_ARGUMENT) naming the field for what plan_tools refuses."""
    tools = []
    for i, t in enumerate(chat.tools):
        params = None
        if t.parameters:
            try:
                params = json.loads(t.parameters)
            except ValueError as e:
                raise ValueError(f"chat.tools[{i}].parameters is not valid JSON: {e}") from None
        tools.append({"type": "function", "function": dict(
            name=t.name, **({"description": t.description} if t.description else {}),
            **({"parameters": params} if params is not None else {}))})
    try:
        functions: list[FunctionTool] = function_tools(tools, "chat.tools")
        which = chat.tool_choice.WhichOneof("choice") if chat.HasField("tool_choice") else None
        choice = (None if which is None else ToolChoice.from_openai(chat.tool_choice.mode, "chat.tool_choice.mode")
                  if which == "mode" else ToolChoice("function", chat.tool_choice.function))
        name = None
        if functions and (choice is None or choice.mode != "none"):
            name = resolve_tool_parser(parser, engine.tokenizer,
                                       getattr(getattr(engine.runner, "model_config", None), "model_type", None))
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
        return plan_tools(functions, choice, parallel_tool_calls=parallel, parser=name, tokenizer=engine.tokenizer)
    except ToolError as e:
        raise ValueError(str(e) if str(e).startswith(e.param) else f"chat.{e.param}: {e}") from None


class CompleteSplitter:
    """Per sample: the text as it streams, and at the end its split into the Complete message."""

    def __init__(self, spec: ChatOutputSpec, starts_in_reasoning: bool, n: int) -> None:
        self.spec = spec
        self.starts_in_reasoning = starts_in_reasoning
        self._texts = [""] * n

    def add(self, index: int, text: str) -> None:
        self._texts[index] += text

    def fill(self, complete: pb.Complete) -> None:
        out = self.spec.new(self.starts_in_reasoning).parse(self._texts[complete.index])
        complete.tool_calls.extend(pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in out.tool_calls)
        if out.content is not None:
            complete.content = out.content
        if out.reasoning is not None:
            complete.reasoning = out.reasoning
        complete.finish_reason = chat_finish_reason(complete.finish_reason, bool(out.tool_calls))
