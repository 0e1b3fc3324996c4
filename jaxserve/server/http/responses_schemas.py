"""Request and response bodies of the OpenAI Responses API (/v1/responses), as pydantic models.

The shapes follow the `openai` package's `types/responses` models. The request refuses unknown
fields (400 naming the field); fields this server knows but cannot honour are declared here and
refused by the handler with the reason (`responses_input.refuse_unsupported`), so a client never
gets an answer that silently is not what it asked for. Input items are kept as dicts here and
validated one by one (`responses_input`), so an error names the item (`input[2].content[0]`).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.server.http.schemas import TokenLogprob
from jaxserve.server.http.schemas import _Request as _APIRequest


class _Request(_APIRequest):
    """The other routes' request base (unknown fields refused, and its checks of the raw body)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(_Request):
    """text.format: text (no constraint), json_object, or json_schema (name and schema required)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses. The first group is implemented; the second is known and refused when
    set (each with its reason); the last is vLLM's sampling extras, as chat has them."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None     # Open Responses' request has them (chat's, as chat checks them)
    frequency_penalty: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None                 # None: True, OpenAI's default
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    include: list[str] | None = None          # "message.output_text.logprobs" only
    top_logprobs: int | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    # known, refused when set: see responses_input.refuse_unsupported
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None


# -- input items (validated one at a time by responses_input) -----------------------------------

class _Item(_Request):
    pass


class InputTextPart(_Item):
    type: Literal["input_text"]
    text: str


class OutputTextPart(_Item):
    """An earlier answer's text, sent back as input."""
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class ReasoningTextPart(_Item):
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(_Item):
    type: Literal["summary_text"]
    text: str


class RefusalPart(_Item):
    type: Literal["refusal"]
    refusal: str


class MessageItem(_Item):
    """EasyInputMessage, Message and an earlier ResponseOutputMessage: a role and its text."""
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Item):
    """A function call the model made (an earlier response's output item), sent back as input."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Item):
    """The caller's result of a function call, by its call_id."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningInputItem(_Item):
    """An earlier response's reasoning item, sent back as input."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: None = None           # never produced here
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionTool(_Item):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# -- the response --------------------------------------------------------------------------------

def new_item_id(prefix: str) -> str:
    """OpenAI's ids: resp_..., msg_..., fc_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's reasoning, split from its answer by the server's --reasoning-parser."""
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = ReasoningItem | OutputMessage | FunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0        # not counted: the prefix cache keeps every full block anyway


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The Response: the request's settings echoed (their effective values), the output items and
    the usage. `output_text` is not here: the openai client computes it from the output."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None       # echoed: it limits built-in tools' calls, and this server has none
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    text: dict[str, Any]
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    service_tier: str = "default"
    usage: ResponseUsage | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
