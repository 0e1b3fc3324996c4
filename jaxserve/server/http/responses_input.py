"""A Responses request's input -> the chat messages the model's template renders, and the refusals
of what this server cannot honour (each a 400 naming the field and saying why).

`instructions` becomes a leading system message (OpenAI: instructions of an earlier response are
not carried over by previous_response_id; the stored conversation holds no instructions). Input
items: messages (user/assistant/system/developer; text parts only), an earlier answer's
`output_text`, and function calls with their outputs as the chat templates' assistant
`tool_calls` and `tool` messages.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from jaxserve.server.http.errors import bad_request
from jaxserve.server.http.responses_schemas import (FunctionCallItem, FunctionCallOutputItem, InputTextPart,
                                                    MessageItem, OutputTextPart, RefusalPart, ResponsesRequest)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Known fields this server does not implement, and why.
_REFUSED_FIELDS = {
    "conversation": "conversations are not stored here; continue one with previous_response_id",
    "prompt": "stored prompt templates are not supported; send the input itself",
    "context_management": "context compaction is not supported",
    "moderation": "moderation is not supported",
    "image": "image generation is not supported",
    "access_programs": "programmatic tool calling is not supported",
    "background_options": "background responses are not supported",
    "prompt_cache_options": "the prefix cache is automatic and has no per-request options",
    "prompt_cache_retention": "the prefix cache is automatic and has no per-request retention",
}


def refuse_unsupported(req: ResponsesRequest, *, tools_supported: bool) -> None:
    for name, why in _REFUSED_FIELDS.items():
        if getattr(req, name) is not None:
            raise bad_request(f"{name} is not supported on this server: {why}", name)
    if req.background:
        raise bad_request("background=true is not supported: a response is generated while its request is open "
                          "(stream=true reads it as it comes)", "background")
    if req.truncation == "auto":
        raise bad_request("truncation='auto' is not supported: an input longer than the model's context is "
                          "refused, not cut", "truncation")
    if req.service_tier not in (None, "auto", "default"):
        raise bad_request(f"service_tier={req.service_tier!r} is not supported; this server has one tier "
                          "('default')", "service_tier")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise bad_request("text.verbosity is a hint OpenAI's models are trained on; this server cannot honour it",
                          "text.verbosity")
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise bad_request("stream_options.include_obfuscation is not supported: events carry no padding",
                          "stream_options.include_obfuscation")
    for i, entry in enumerate(req.include or []):
        if entry != LOGPROBS_INCLUDE:
            raise bad_request(f"include[{i}]={entry!r} is not supported; only {LOGPROBS_INCLUDE!r}", f"include[{i}]")
    if req.top_logprobs is not None and LOGPROBS_INCLUDE not in (req.include or []):
        raise bad_request(f"top_logprobs needs include=[{LOGPROBS_INCLUDE!r}]", "top_logprobs")
    if req.reasoning is not None and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning is not supported on /v1/responses yet: this server has no reasoning parser "
                          "to separate a model's reasoning from its answer", "reasoning")
    if not tools_supported:
        if req.tools:
            raise bad_request("tools are not yet implemented on /v1/responses", "tools")
        if req.tool_choice is not None and req.tool_choice not in ("none", "auto"):
            raise bad_request(f"tool_choice={req.tool_choice!r} needs tools, which are not yet implemented on "
                              "/v1/responses", "tool_choice")


def input_messages(req: ResponsesRequest, *, tools_supported: bool) -> list[dict[str, Any]]:
    """The request's input as chat messages (without the instructions)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input is empty", "input")
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = raw.get("type", "message")
        if kind == "message":
            m = _validated(MessageItem, raw, where)
            out.append({"role": m.role, "content": _message_text(m, where)})
        elif kind in ("function_call", "function_call_output"):
            if not tools_supported:
                raise bad_request(f"{where}: {kind} items need tools, which are not yet implemented on "
                                  "/v1/responses", where)
            if kind == "function_call":
                _append_call(out, _validated(FunctionCallItem, raw, where))
            else:
                o = _validated(FunctionCallOutputItem, raw, where)
                out.append({"role": "tool", "tool_call_id": o.call_id,
                            "content": o.output if isinstance(o.output, str) else _parts_text(o.output, where)})
        elif kind == "reasoning":
            raise bad_request(f"{where}: reasoning items are not supported (this server emits none)", where)
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references are not supported; send the item, or continue with "
                              "previous_response_id", where)
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (messages, function_call "
                              "and function_call_output are)", where)
    return out


def with_instructions(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": instructions}] if instructions else []) + messages


def as_template_roles(messages: list[dict[str, Any]], roles: frozenset[str]) -> list[dict[str, Any]]:
    """OpenAI's developer role is the system role of open models' templates, unless the template
    names a developer role of its own."""
    if "developer" in roles:
        return messages
    return [dict(m, role="system") if m["role"] == "developer" else m for m in messages]


def _validated(model: type[BaseModel], raw: dict, where: str):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        param = f"{where}.{loc}" if loc else where
        raise bad_request(f"{param}: {first['msg']}", param) from None


def _message_text(m: MessageItem, where: str) -> str:
    if isinstance(m.content, str):
        return m.content
    return _parts_text(m.content, f"{where}.content")


_PARTS = {"input_text": InputTextPart, "output_text": OutputTextPart, "refusal": RefusalPart}


def _parts_text(parts: list[dict[str, Any]], where: str) -> str:
    texts = []
    for j, raw in enumerate(parts):
        at = f"{where}[{j}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in _PARTS:
            raise bad_request(f"{at}: only text parts are supported (input_text, output_text, refusal); got "
                              f"type {kind!r}", at)
        part = _validated(_PARTS[kind], raw, at)
        texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "".join(texts)


def _append_call(out: list[dict[str, Any]], call: FunctionCallItem) -> None:
    """A function call joins the assistant message before it (its text and its calls are one turn
    to a chat template), or starts one."""
    entry = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1] = dict(out[-1], tool_calls=[*out[-1].get("tool_calls", []), entry])
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [entry]})
