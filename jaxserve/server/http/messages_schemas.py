"""Request and response bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens),
as pydantic models.

The shapes follow Anthropic's API reference (the `anthropic` package's `types`). As on every route,
unknown fields are refused (a 400 naming the field); fields Anthropic has that this server cannot
honour are declared here and refused by the handler with the reason (`messages_input.REFUSED_FIELDS`).
Message content blocks and tools are kept as dicts here and validated one by one
(`messages_input`), so an error names the block (`messages[2].content[0]`) and an image or a server
tool gets its own reason, not a union's list of mismatches.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from jaxserve.server.http.schemas import _Request

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def new_message_id(prefix: str = "msg") -> str:
    """Anthropic's ids: msg_..., toolu_..."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class CacheControl(_Request):
    """A prompt-caching breakpoint: accepted, and nothing more is done with it (the prefix cache is
    automatic: every full block of every prompt is cached)."""
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# -- content blocks (validated one at a time by messages_input) ---------------------------------

class TextBlockIn(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(default=None, max_length=0)   # none are produced here


class ToolUseBlockIn(_Request):
    """A call an earlier assistant turn made."""
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockIn(_Request):
    """A user turn's result of an earlier call, by its tool_use_id."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None    # text blocks only
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlockIn(_Request):
    """An earlier assistant turn's thinking, sent back (its signature is not checked: none is made here)."""
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolIn(_Request):
    """A client tool: the model is told its name, description and input schema, and its calls'
    inputs validate against the schema where the call is constrained (tool_choice any / tool)."""
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class MessageIn(_Request):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


# -- the request's options ------------------------------------------------------------------------

class ToolChoiceAuto(_Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Request):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Request):
    type: Literal["none"]


ToolChoiceIn = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class ThinkingEnabled(_Request):
    """budget_tokens is Anthropic's lower bound and must be below max_tokens; it is a hint (the
    answer's length, thinking included, is bounded by max_tokens alone)."""
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)


class ThinkingAdaptive(_Request):
    type: Literal["adaptive"]


class ThinkingDisabled(_Request):
    type: Literal["disabled"]


ThinkingIn = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class Metadata(_Request):
    user_id: str | None = Field(default=None, max_length=256)    # a label: accepted, unused


class _Conversation(_Request):
    """What both routes render: the model (absent: the served one, as on the other routes), the
    turns, the system prompt, the tools and thinking."""
    model: str | None = None
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None     # a string or text blocks
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    cache_control: CacheControl | None = None
    # known, refused when set: see messages_input.REFUSED_FIELDS
    mcp_servers: Any = None
    context_management: Any = None
    output_config: Any = None


class MessagesRequest(_Conversation):
    """POST /v1/messages. max_tokens is required, as Anthropic's; the sampling ranges are
    Anthropic's (temperature in [0, 1])."""
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None   # one tier here: both mean it
    container: Any = None                     # known, refused when set


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the input tokens /v1/messages would run for these turns."""


# -- the answer -----------------------------------------------------------------------------------

class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str
    citations: None = None


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""        # no signature is made here (nothing checks one sent back)


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock


class MessageUsage(BaseModel):
    """Anthropic's split: input_tokens are the prompt tokens the prefix cache did not serve,
    cache_read_input_tokens those it did (their sum is the prompt); nothing is counted as written
    to a cache (every full block is cached anyway)."""
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class MessageTokensCount(BaseModel):
    input_tokens: int


class AnthropicErrorBody(BaseModel):
    type: str
    message: str
    # jaxserve's: the refusal code no request schema can express (jaxserve/refusals.py), as the
    # OpenAI-shaped errors carry it; absent otherwise
    code: str | None = None


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorBody
