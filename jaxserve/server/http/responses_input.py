"""A Responses request's input -> the chat messages the model's template renders, and the refusals
of what this server cannot honour (each a 400 naming the field and saying why).

`instructions` becomes a leading system message (OpenAI: instructions of an earlier response are
not carried over by previous_response_id; the stored conversation holds no instructions). Input
items: messages (user/assistant/system/developer; text parts only), an earlier answer's
`output_text`, and function calls with their outputs as the chat templates' assistant
`tool_calls` and `tool` messages.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from pydantic import BaseModel, ValidationError

from jaxserve.refusals import ConflictingFields, InvalidJSONText
from jaxserve.server.http.errors import bad_request
from jaxserve.server.http.responses_schemas import (FunctionCallItem, FunctionCallOutputItem, FunctionTool,
                                                    InputTextPart, MessageItem, OutputTextPart, ReasoningInputItem,
                                                    ReasoningTextPart, RefusalPart, ResponsesRequest,
                                                    SummaryTextPart, new_item_id)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Known fields this server does not implement, and why.
REFUSED_FIELDS = {
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


def refuse_unsupported(req: ResponsesRequest) -> None:
    for name, why in REFUSED_FIELDS.items():
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
    if req.stream_options is not None and not req.stream:   # as chat: it would do nothing
        raise bad_request("stream_options is only allowed with stream=true", "stream_options", ConflictingFields.code)
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise bad_request("stream_options.include_obfuscation is not supported: events carry no padding",
                          "stream_options.include_obfuscation")
    for i, entry in enumerate(req.include or []):
        if entry != LOGPROBS_INCLUDE:
            raise bad_request(f"include[{i}]={entry!r} is not supported; only {LOGPROBS_INCLUDE!r}", f"include[{i}]")
    if req.top_logprobs is not None and LOGPROBS_INCLUDE not in (req.include or []):
        raise bad_request(f"top_logprobs needs include=[{LOGPROBS_INCLUDE!r}]", "top_logprobs", ConflictingFields.code)
    if req.reasoning is not None and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning settings (effort, summary) are not supported: this server cannot tell a model how "
                          "much to think; a server started with --reasoning-parser returns the model's reasoning as "
                          "reasoning items", "reasoning")


def refuse_logprobs_of_parsed_output(req: ResponsesRequest) -> None:
    """With a tool or reasoning parser the text is split into items; its tokens' logprobs are not."""
    if LOGPROBS_INCLUDE in (req.include or []):
        raise bad_request(f"include {LOGPROBS_INCLUDE!r} is not supported when the answer is parsed into reasoning "
                          "or function calls (tools given, or a server with --reasoning-parser): the tokens' "
                          "logprobs are not split between the items", "include")


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}`."""
    if req.tools is None:
        return None
    out = []
    for where, kind, raw in typed_items(req.tools, "tools"):
        if kind != "function":
            raise bad_request(f"{where}: tools of type {kind!r} are not available on this server; only function "
                              "tools are (built-in tools such as web_search or file_search are OpenAI's own)", "tools")
        t = validated(FunctionTool, raw, where)
        out.append({"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' tool_choice as chat's: the modes as they are, a named function
    `{"type": "function", "name"}` as `{"type": "function", "function": {"name"}}`."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice={choice!r} is not supported; 'auto', 'none', 'required' or "
                      "{'type': 'function', 'name': ...} are (allowed_tools and built-in tools are not)", "tool_choice")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as chat messages (without the instructions), in the chat request's
    shape (ChatMessage: calls with their arguments' JSON text)."""
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
            m = validated(MessageItem, raw, where)
            text = _message_text(m, where)
            if m.role == "assistant" and out and _only_reasoning(out[-1]):
                out[-1] = dict(out[-1], content=text)   # the answer of the reasoning before it
            else:
                out.append({"role": m.role, "content": text})
        elif kind in ("function_call", "function_call_output"):
            if kind == "function_call":
                _append_call(out, validated(FunctionCallItem, raw, where), where)
            else:
                o = validated(FunctionCallOutputItem, raw, where)
                out.append({"role": "tool", "tool_call_id": o.call_id,
                            "content": o.output if isinstance(o.output, str) else _parts_text(o.output, where)})
        elif kind == "reasoning":   # the assistant turn's reasoning, which its text and calls then join
            r = validated(ReasoningInputItem, raw, where)
            parts = r.content if r.content else r.summary
            out.append({"role": "assistant", "content": "", "reasoning": _parts_text(parts, f"{where}.content")})
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


def type_of(raw: Any) -> str | None:
    """A typed object's `type` (tools, content parts); None when it has no string one, or is no object."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    return kind if isinstance(kind, str) else None


def typed_items(items: list, field: str) -> Iterator[tuple[str, str | None, Any]]:
    """Each item of a list of typed objects with where it is (`tools[2]`) and its type_of."""
    for i, raw in enumerate(items):
        yield f"{field}[{i}]", type_of(raw), raw


def validated(model: type[BaseModel], raw: dict, where: str):
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


TEXT_PARTS = {"input_text": InputTextPart, "output_text": OutputTextPart, "refusal": RefusalPart,
          "reasoning_text": ReasoningTextPart, "summary_text": SummaryTextPart}


def _parts_text(parts: list[dict[str, Any]], where: str) -> str:
    texts = []
    for j, raw in enumerate(parts):
        at = f"{where}[{j}]"
        kind = type_of(raw)
        if kind not in TEXT_PARTS:
            raise bad_request(f"{at}: only text parts are supported (input_text, output_text, refusal, "
                              f"reasoning_text, summary_text); got "
                              f"type {kind!r}", at)
        part = validated(TEXT_PARTS[kind], raw, at)
        texts.append(part.refusal if isinstance(part, RefusalPart) else part.text)
    return "".join(texts)


def _only_reasoning(m: dict[str, Any]) -> bool:
    return m["role"] == "assistant" and "reasoning" in m and not m["content"] and "tool_calls" not in m


def _append_call(out: list[dict[str, Any]], call: FunctionCallItem, where: str) -> None:
    """A function call joins the assistant message before it (its text and its calls are one turn
    to a chat template), or starts one."""
    try:
        args = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError as e:
        raise bad_request(f"{where}.arguments is not valid JSON: {e}", f"{where}.arguments",
                          InvalidJSONText.code) from None
    if not isinstance(args, dict):
        raise bad_request(f"{where}.arguments must be a JSON object", f"{where}.arguments", InvalidJSONText.code)
    entry = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1] = dict(out[-1], tool_calls=[*out[-1].get("tool_calls", []), entry])
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [entry]})


def listed_input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as `GET /v1/responses/{id}/input_items` lists it: each item with an id
    (its own, or a new one) and a status, a message's string content as a text part."""
    raw_items = ([{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input)
    out = []
    for raw in raw_items:
        kind = raw.get("type", "message")
        model = {"message": MessageItem, "function_call": FunctionCallItem,   # input_messages took no other kind
                 "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningInputItem}[kind]
        item = model.model_validate(raw).model_dump(exclude_none=True)
        item["id"] = item.get("id") or new_item_id({"message": "msg", "function_call": "fc",
                                                     "function_call_output": "fco", "reasoning": "rs"}[kind])
        item["status"] = item.get("status") or "completed"
        if kind == "message" and isinstance(item["content"], str):
            part = ({"type": "output_text", "text": item["content"], "annotations": []} if item["role"] == "assistant"
                    else {"type": "input_text", "text": item["content"]})
            item["content"] = [part]
        out.append(item)
    return out
