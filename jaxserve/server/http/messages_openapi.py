"""What /openapi.json says of the Messages routes (http/messages.py) beyond FastAPI's document, so it
stays true of them: their errors are Anthropic's body (AnthropicErrorResponse) and a full server
answers 529, `x-api-key` is a second way to send the key, `anthropic-version` is an accepted
header, and the request schemas are the ones the route enforces (server/http/openapi.py applies
its limits; here the blocks each role's turns hold, which the route validates one at a time, the
client tools' shape, the fields refused, and thinking only `disabled` on a server without
--reasoning-parser).
"""

from __future__ import annotations

import copy

from jaxserve.server.http.messages_errors import is_messages_path

ERROR_SCHEMA = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
VERSION_HEADER = {"name": "anthropic-version", "in": "header", "required": False,
                  "description": "accepted, any version: the answer does not depend on it",
                  "schema": {"type": "string"}}
API_KEY_SCHEME = {"type": "apiKey", "in": "header", "name": "x-api-key"}


def describe_messages_operation(path: str, op: dict, *, api_key: bool) -> None:
    """An operation of a Messages path: Anthropic's error body for every error status, 529 for
    the server's 429, the version header, and x-api-key beside the bearer scheme."""
    if not is_messages_path(path):
        return
    responses = op["responses"]
    if "429" in responses:
        responses["529"] = responses.pop("429")
        responses["529"]["description"] = ("overloaded_error: the server's streams are full (--max-concurrent-streams) "
                                           "or its queue is; retry after `Retry-After`")
    for status, response in responses.items():
        if status != "200":
            response["content"] = {"application/json": {"schema": copy.deepcopy(ERROR_SCHEMA)}}
    if "400" in responses:
        responses["400"]["description"] = ("invalid_request_error: the message names the field; `error.code` (jaxserve's "
                                           "addition) a refusal no schema can express")
    if "401" in responses:
        responses["401"]["description"] = "authentication_error: no valid API key (`x-api-key` or `Authorization: Bearer`)"
    op.setdefault("parameters", []).append(copy.deepcopy(VERSION_HEADER))
    if api_key:
        op["security"] = [{"bearer": []}, {"x_api_key": []}]


def describe_messages_requests(c: dict, *, set_fields, ref, stop: dict, max_stops: int, most_tokens: int,
                               reasoning: bool) -> None:
    """The Messages request schemas as the route checks them (`set_fields(components, model,
    **fields)`, `ref(model)`: openapi.py's helpers; a stop sequence's schema, the most of them
    and the most max_tokens: this server's limits)."""
    from jaxserve import sampling_params as sp
    from jaxserve.server.http import messages_schemas as ms
    from jaxserve.server.http.messages_input import REFUSED_FIELDS
    from jaxserve.tool_parsers.plan import TOOL_NAME

    nullable = _nullable
    text_blocks = {"type": "array", "items": ref(ms.TextBlockIn)}
    user = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"const": "user"}, "content": {"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"anyOf": [ref(ms.TextBlockIn), ref(ms.ToolResultBlockIn)]}}]}}}
    assistant = {"type": "object", "required": ["role", "content"], "additionalProperties": False,
                 "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [
                     {"type": "string"},
                     {"type": "array", "items": {"anyOf": [ref(ms.TextBlockIn), ref(ms.ToolUseBlockIn),
                                                           ref(ms.ThinkingBlockIn)]}}]}}}
    tools = nullable({"type": "array", "items": ref(ms.ToolIn)})     # the component first: then its fields are set
    set_fields(c, "ToolResultBlockIn", content=nullable({"anyOf": [{"type": "string"}, text_blocks]}))
    set_fields(c, "ToolIn", name={"type": "string", "pattern": f"^{TOOL_NAME.pattern}$"},
               input_schema={"type": "object", "required": ["type"], "properties": {"type": {"const": "object"}}})
    nothing = {"type": "null"}
    thinking = None if reasoning else nullable(ref(ms.ThinkingDisabled))   # enabled / adaptive need the parser
    for model in ("MessagesRequest", "CountTokensRequest"):
        set_fields(c, model, messages={"type": "array", "minItems": 1, "items": {"anyOf": [user, assistant]}},
                   system=nullable({"anyOf": [{"type": "string"}, text_blocks]}),
                   tools=tools,
                   **dict.fromkeys(REFUSED_FIELDS, nothing), **({"thinking": thinking} if thinking else {}))
    set_fields(c, "MessagesRequest", max_tokens={"type": "integer", "minimum": 1, "maximum": most_tokens},
               stop_sequences=nullable({"type": "array", "items": stop, "maxItems": max_stops}),
               top_k=nullable({"type": "integer", "minimum": 0, "maximum": sp.MAX_INT32}))


def _nullable(schema: dict) -> dict:
    return {"anyOf": [copy.deepcopy(schema), {"type": "null"}]}
