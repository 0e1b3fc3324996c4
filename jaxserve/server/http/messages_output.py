"""An answer in Anthropic's shapes: its content blocks (thinking, text, tool_use, in the order chat's
parsers split them), its stop_reason and stop_sequence, and the usage. Shared by the whole answer
and the event stream, so the two agree."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.chat_output import ChatMessageOut
from jaxserve.server.http.messages_schemas import (ContentBlock, MessageObject, MessageUsage, StopReason, TextBlock,
                                                   ThinkingBlock, ToolUseBlock, new_message_id)
from jaxserve.server.http.schemas import Usage


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as tool_use's input object; a call cut short by max_tokens,
    whose arguments do not parse yet, has the empty object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(out: ChatMessageOut) -> list[ContentBlock]:
    """A whole answer's blocks; an empty answer has none."""
    blocks: list[ContentBlock] = []
    if out.reasoning:
        blocks.append(ThinkingBlock(thinking=out.reasoning))
    if out.content:
        blocks.append(TextBlock(text=out.content))
    blocks += [ToolUseBlock(id=new_message_id("toolu"), name=c.name, input=tool_input(c.arguments))
               for c in out.tool_calls]
    return blocks


def stop_of(finish_reason: str | None, stop_reason: int | str | None, called: bool,
            stop_sequences: list[str] | None) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence): tool_use for an answer that ended (not cut) with calls,
    max_tokens for one cut at max_tokens or the model's context, stop_sequence (naming it) for one
    that met a stop sequence, end_turn otherwise (the model ended its turn)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return "end_turn", None


def message_usage(u: Usage) -> MessageUsage:
    cached = u.prompt_tokens_details.cached_tokens
    return MessageUsage(input_tokens=u.prompt_tokens - cached, output_tokens=u.completion_tokens,
                        cache_read_input_tokens=cached)


def message(id: str, model: str, content: list[ContentBlock], usage: Usage, stop: tuple[StopReason | None, str | None]
            = (None, None)) -> MessageObject:
    return MessageObject(id=id, model=model, content=content, stop_reason=stop[0], stop_sequence=stop[1],
                         usage=message_usage(usage))
