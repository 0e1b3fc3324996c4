"""A Messages request's turns, tools and options -> the chat request the chat path serves, and the
refusals of what this server cannot honour (each a 400 saying why).

`system` becomes a leading system message. A user turn's text blocks are a user message and each
`tool_result` block a `tool` message (by its tool_use_id); an assistant turn's text, `thinking`
(the template's reasoning_content) and `tool_use` blocks (the template's tool_calls, their input
as the arguments object) are one assistant message, as the chat templates render a turn. Tools
are chat's function tools (input_schema as the parameters); tool_choice auto / any / tool / none
are chat's auto / required / a named function / none, disable_parallel_tool_use the opposite of
parallel_tool_calls. Turns are rendered as they come (Anthropic merges consecutive turns of one
role; a chat template takes them apart, or refuses them).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from jaxserve.refusals import ConflictingFields, FeatureDisabled, PrefillRefused
from jaxserve.server.http.errors import bad_request
from jaxserve.server.http.responses_input import type_of, typed_items, validated
from jaxserve.server.http.messages_schemas import (MessagesRequest, TextBlockIn, ThinkingBlockIn, ToolIn,
                                                   ToolResultBlockIn, ToolUseBlockIn, _Conversation)

# Known fields this server does not implement, and why.
REFUSED_FIELDS = {
    "container": "code-execution containers are Anthropic's own; this server runs no tools",
    "mcp_servers": "MCP servers are not connected here; run the tools in the client and send tool_result blocks",
    "context_management": "context editing is not supported: a conversation longer than the model's context is "
                          "refused, not cut",
    "output_config": "output effort and formats are not supported here",
}

# the blocks each role's content may hold, by type
USER_BLOCKS = {"text": TextBlockIn, "tool_result": ToolResultBlockIn}
ASSISTANT_BLOCKS = {"text": TextBlockIn, "tool_use": ToolUseBlockIn, "thinking": ThinkingBlockIn}
_WHY_NOT = {
    "image": "image content is not supported: this server serves a text-only model",
    "document": "document content is not supported: send the document's text in a text block",
    "search_result": "search result blocks are not supported: send their text in a text block",
    "redacted_thinking": "redacted thinking is not supported: this server redacts nothing, so it cannot read "
                         "such a block back",
}


def refuse_unsupported(req: _Conversation) -> None:
    for name, why in REFUSED_FIELDS.items():
        if getattr(req, name, None) is not None:
            raise bad_request(f"{name} is not supported on this server: {why}", name)


def thinking_template_kwargs(req: _Conversation, reasoning_parser) -> dict[str, Any]:
    """`thinking` enabled or adaptive asks for thinking blocks: the server's --reasoning-parser
    splits them out (without one, a 400: nothing would); disabled tells a thinking template not to
    think (its `enable_thinking`); absent leaves the template's own default."""
    t = req.thinking
    if t is None:
        return {}
    if t.type == "disabled":
        return {"enable_thinking": False}
    if reasoning_parser is None:
        raise bad_request(f"thinking type {t.type!r} needs a server started with --reasoning-parser (it splits the "
                          "model's thinking into thinking blocks); send thinking type 'disabled', or none",
                          "thinking", FeatureDisabled.code)
    if isinstance(req, MessagesRequest) and t.type == "enabled" and t.budget_tokens >= req.max_tokens:
        raise bad_request(f"thinking.budget_tokens={t.budget_tokens} must be less than max_tokens={req.max_tokens}",
                          "thinking.budget_tokens", ConflictingFields.code)
    return {}


def chat_tools(req: _Conversation) -> list[dict[str, Any]] | None:
    """Anthropic's client tools as chat's `{"type": "function", "function": {...}}`."""
    if req.tools is None:
        return None
    out = []
    for where, kind, raw in typed_items(req.tools, "tools"):
        if kind not in (None, "custom"):
            raise bad_request(f"{where}: tools of type {kind!r} are not available on this server; only client tools "
                              "(name, description, input_schema) are (server tools are Anthropic's own)", where)
        t = validated(ToolIn, raw, where)
        if t.input_schema.get("type") != "object":
            raise bad_request(f"{where}.input_schema must be a JSON schema of type 'object'", f"{where}.input_schema")
        fn = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(req: _Conversation) -> tuple[str | dict[str, Any] | None, bool]:
    """tool_choice as chat's (tool_choice, parallel_tool_calls)."""
    c = req.tool_choice
    if c is None:
        return None, True
    parallel = not getattr(c, "disable_parallel_tool_use", None)
    if c.type == "tool":
        return {"type": "function", "function": {"name": c.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[c.type], parallel


def chat_conversation(req: _Conversation) -> list[dict[str, Any]]:
    """The system prompt and the turns as chat messages, in the chat request's shape (ChatMessage:
    calls with their arguments as objects)."""
    out: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    names: dict[str, str] = {}     # tool_use id -> the tool's name, for the tool turn that answers it
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user_turn(m.content, f"{where}.content", names)
        else:
            out.append(_assistant_turn(m.content, f"{where}.content", names))
    if req.messages[-1].role == "assistant":
        raise bad_request(f"messages[{len(req.messages) - 1}] is an assistant turn: continuing a partial answer "
                          "(prefill) is not supported on this server; end with a user turn", "messages",
                          PrefillRefused.code)
    return out


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(_text_block(raw, f"system[{j}]", "system") for j, raw in enumerate(system))


def _user_turn(blocks: list[dict[str, Any]], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for j, raw in enumerate(blocks):
        at = f"{where}[{j}]"
        block = _block(raw, at, USER_BLOCKS, "user")
        if isinstance(block, TextBlockIn):
            text.append(block.text)
            continue
        if text:   # text before a result: its own user message, in order
            out.append({"role": "user", "content": "".join(text)})
            text = []
        result = block.content
        content = result if isinstance(result, str) or result is None else "".join(
            _text_block(r, f"{at}.content[{k}]", "tool_result content") for k, r in enumerate(result))
        message = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""}
        if block.tool_use_id in names:
            message["name"] = names[block.tool_use_id]
        out.append(message)
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_turn(blocks: list[dict[str, Any]], where: str, names: dict[str, str]) -> dict[str, Any]:
    text, thinking, calls = [], [], []
    for j, raw in enumerate(blocks):
        block = _block(raw, f"{where}[{j}]", ASSISTANT_BLOCKS, "assistant")
        if isinstance(block, TextBlockIn):
            text.append(block.text)
        elif isinstance(block, ThinkingBlockIn):
            thinking.append(block.thinking)
        else:
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _block(raw: Any, where: str, kinds: dict[str, type[BaseModel]], role: str):
    kind = type_of(raw)
    if kind in _WHY_NOT:
        raise bad_request(f"{where}: {_WHY_NOT[kind]}", where)
    if kind not in kinds:
        raise bad_request(f"{where}: a {role} turn's content blocks are {', '.join(kinds)}; got type {kind!r}", where)
    return validated(kinds[kind], raw, where)


def _text_block(raw: Any, where: str, what: str) -> str:
    kind = type_of(raw)
    if kind != "text":
        why = _WHY_NOT.get(kind, f"{what} takes text blocks only; got type {kind!r}")
        raise bad_request(f"{where}: {why}", where)
    return validated(TextBlockIn, raw, where).text
