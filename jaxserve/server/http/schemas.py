"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Request fields are those of the OpenAI API plus vLLM's extras (top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, priority, cache_salt, ...). Unknown fields are refused (400 naming the
field) rather than ignored: a client that sends `functions` or `best_of` would otherwise get an
answer that silently is not what it asked for.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxserve.server.http.request_checks import check_request_body


class _Request(BaseModel):
    # strict: a field takes its JSON type only (no "16" or true for 16, no "true" for true: a
    # client's bug is a 400 naming the field, not a guess); a float field still takes a JSON integer
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return check_request_body(cls, data)   # lone surrogates; --lenient-api's unknown fields


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's structured_outputs: exactly one of a schema, a regex, a choice list or a grammar."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None         # None: 1.0, OpenAI's default
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16              # 0 with echo: the prompt alone (vLLM's behaviour)
    logprobs: int | None = None              # top logprobs per token, 0..20
    echo: bool = False                       # the prompt (and its logprobs, with logprobs) before the completion
    prompt_logprobs: int | None = None       # vLLM's extra: choices[].prompt_logprobs, per prompt token
    suffix: str | None = None
    best_of: int | None = None


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"   # OpenAI sends JSON text; an object is taken too


class ToolCallIn(_Request):
    """A call of an earlier assistant message in the history."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    # other per-message fields are ignored when null or empty (a client's echo of the message it got:
    # refusal, audio, annotations), refused otherwise (http/request_checks.py)
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None   # an assistant's calls
    tool_call_id: str | None = None              # a tool message: the call it answers
    reasoning: str | None = None                 # an assistant's reasoning, under either name
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None               # the arguments are always held to the schema when constrained


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})   # an empty chat is a 400
    max_tokens: int | None = None            # None: up to max_model_len
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    # "auto" (None's meaning) | "required" | "none" | {"type": "function", "function": {"name": ...}},
    # checked by tool_parsers.ToolChoice (one 400 naming tool_choice for any wrong value)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


# -- responses -------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _Choice(BaseModel):
    """What every response choice carries (the kinds add their text or message and logprobs)."""
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _Response(BaseModel):
    """What every response and streamed chunk carries (the kinds add `object` and `choices`)."""
    id: str
    created: int
    model: str
    usage: Usage | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob, one of a prompt position's entries (keyed by token id)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    # vLLM's extra (prompt_logprobs in the request): per prompt token, None for the first, else
    # {token id: its Logprob} for the prompt token and the top alternatives
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                           # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None                      # None: the answer is only tool calls
    # the reasoning of a thinking model (--reasoning-parser), under both names clients read
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """OpenAI's streamed call: the first piece has id, type and the name (arguments ""), the
    next ones only argument fragments."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Response):
    """A streamed completion chunk has the response's shape (object "text_completion")."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the model's template (exactly one
    of them; tools only with messages: http/tokenization.py refuses the rest, as the schema says)."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"},
                                                "tools": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1},
                                                  "prompt": {"type": "null"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list["ChatMessage"] | None = None
    # rendered into the messages' template as a chat with these tools renders (vLLM's field)
    tools: list["ChatTool"] | None = None
    add_special_tokens: bool | None = None   # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxserve"
    max_model_len: int
    root: str | None = None      # vLLM's: the base model's name, or the directory an adapter was loaded from
    parent: str | None = None    # a LoRA adapter's base model; None for the base model itself


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
