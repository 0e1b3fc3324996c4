"""GET /openapi.json describes the server that serves it.

FastAPI's document is generated from the request models the routes validate with; what it
cannot know is added here, once the engine serves (until then the document is built again on
each request, without what only the engine knows):

- **Every status a route sends**, each with OpenAI's error body (`ErrorResponse`): 400 for a bad
  body, query or path (FastAPI's 422 is never sent: the server answers 400), 401 behind the API
  key, 404 for an unknown model, response id or adapter, 408 and 413 for a body too slow or too
  big, 429 when the server's streams are full, 503 while it is not serving.
- **What each 200 carries**: JSON by its model; a server-sent event stream where the request can
  ask for one; `/metrics` as Prometheus text; `/health` as an empty body; the LoRA routes as text.
- **This server's limits** in the request schemas: token ids below the vocabulary size, at most
  max_model_len - 1 of them per prompt, `n` up to `--max-n`, `max_tokens` up to what
  `--max-tokens-limit` and max_model_len allow, at most `--max-prompts` prompts and
  `--max-embedding-inputs` inputs.
- **Only the routes it serves**: `/v1/embeddings` with `--enable-embeddings`, the LoRA routes
  with `--enable-lora` (on other servers they answer a 400 naming the flag, and are not listed).
- **Anthropic's Messages routes as Anthropic's** (http/messages_openapi.py): their error body,
  529 where the others say 429, `x-api-key` beside the bearer scheme, `anthropic-version`.

What a JSON Schema cannot say is refused with a `code` naming why (REFUSAL_CODES): a prompt and
max_tokens that together pass max_model_len, a grammar or tool schema that does not compile, a
conversation the chat template refuses. The schemathesis run of the slow tests
(tests/server/test_openapi_conformance.py) accepts those refusals of schema-valid requests, and
no others.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from jaxserve import sampling_params as sp
from jaxserve.server.chat_roles import chat_roles
from jaxserve.server.http.messages_openapi import API_KEY_SCHEME, describe_messages_operation, describe_messages_requests
from jaxserve.server.http.messages_schemas import AnthropicErrorResponse
from jaxserve.server.http.schemas import ErrorResponse
from jaxserve.server.state import Phase
from jaxserve.tool_parsers.plan import TOOL_NAME

# 400 codes for refusals a request schema cannot express (they depend on the prompt's tokens,
# the model's template or a grammar's meaning, not on the request's shape)
REFUSAL_CODES = {
    "conflicting_fields": "fields valid alone that this server refuses together (best_of other than n, ...)",
    "feature_disabled": "a feature the server was started without (echo with logprobs asks for prompt logprobs)",
    "invalid_json_text": "a string that must hold JSON text (a tool call's arguments: an object) does not",
    "context_length_exceeded": "the prompt's tokens (with max_tokens) do not fit max_model_len or the KV pool",
    "input_tokens_exceeded": "the request's prompts together pass --max-input-tokens",
    "invalid_grammar": "a structured-output grammar, regex or JSON schema (a tool's parameters too) does not compile",
    "template_refused": "the model's chat template refuses these messages or tools",
    "prefill_unsupported": "a Messages conversation ends with an assistant turn (a prefill), which is not continued",
}

_STATUS = {
    400: "the request is not valid: `error.param` names the field, `error.code` a refusal no schema can express",
    401: "no valid API key (`Authorization: Bearer KEY`)",
    404: "an unknown model, stored response or adapter",
    408: "the request body took longer than --http-body-timeout to arrive",
    413: "the request body is bigger than --max-message-bytes",
    429: "the server's streams are full (--max-concurrent-streams) or its queue is; retry after `Retry-After`",
    503: "the server is not serving (starting, paused, asleep or draining)",
}
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")   # served without the key
NOT_FOUND_PATHS = ("/v1/models/{model_id}", "/tokenize", "/detokenize", "/v1/messages/count_tokens",
                   "/v1/responses/{response_id}",
                   "/v1/responses/{response_id}/input_items", "/v1/responses/{response_id}/cancel",
                   "/v1/unload_lora_adapter", "/v1/load_lora_adapter")
# 409s: well-formed requests the server's state refuses
CONFLICTS = {"/v1/responses/{response_id}/cancel": "the response is not running in the background, so there is "
                                                   "nothing to cancel",
             "/v1/load_lora_adapter": "an adapter (or the base model) already has that name"}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/messages")
STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# the routes' 200 bodies where the route returns a JSONResponse of its own (no response_model)
RESPONSE_MODELS = {
    ("post", "/v1/completions"): "CompletionResponse",
    ("post", "/v1/chat/completions"): "ChatCompletionResponse",
    ("post", "/v1/embeddings"): "EmbeddingResponse",
    ("post", "/v1/responses"): "ResponseObject",
    ("get", "/v1/responses/{response_id}"): "ResponseObject",
    ("post", "/v1/responses/{response_id}/cancel"): "ResponseObject",
    ("get", "/v1/responses/{response_id}/input_items"): "InputItemList",
    ("delete", "/v1/responses/{response_id}"): "DeletedResponse",
    ("post", "/v1/messages"): "MessageObject",
    ("post", "/v1/messages/count_tokens"): "MessageTokensCount",
}


# query parameters as the routes check them (http/responses.py)
QUERY_PARAMETERS = {
    ("/v1/responses/{response_id}", "stream"): {"type": "boolean", "enum": [False], "default": False},
    ("/v1/responses/{response_id}/input_items", "limit"): {"type": "integer", "minimum": 1, "maximum": 100,
                                                             "default": 20},
    ("/v1/responses/{response_id}/input_items", "order"): {"type": "string", "enum": ["asc", "desc"],
                                                             "default": "desc"},
    ("/v1/responses/{response_id}/input_items", "include"): {"anyOf": [{"type": "array", "maxItems": 0},
                                                                         {"type": "null"}]},
}


# what each data line of a stream holds (OpenAPI 3.1: a text/event-stream schema is one event's)
STREAM_CHUNKS = {"/v1/completions": "CompletionChunk", "/v1/chat/completions": "ChatCompletionChunk",
                 "/v1/responses": None,     # Responses: typed events (http/responses_events.py)
                 "/v1/messages": None}      # Anthropic's typed events (http/messages_events.py)


def _event_schema(chunk: str | None) -> dict:
    data: dict[str, Any] = {"type": "string", "contentMediaType": "application/json"}
    if chunk is not None:
        data["contentSchema"] = {"$ref": f"#/components/schemas/{chunk}"}
    return {"type": "object", "required": ["data"],
            "properties": {"event": {"type": "string"},
                           "data": {"anyOf": [{"const": "[DONE]"}, data]} if chunk is not None else data}}


def describe_server(app: FastAPI, front, *, api_key: bool) -> None:
    """Replace `app.openapi` with the document described above (`front`: the OpenAIFront whose
    engine and limits it reads)."""
    from jaxserve.server.http import schemas, embedding_schemas, messages_schemas, responses_schemas

    models = {name: getattr(module, name) for module in (schemas, embedding_schemas, responses_schemas,
                                                         messages_schemas)
              for name in dir(module)
              if name in set(RESPONSE_MODELS.values()) | {c for c in STREAM_CHUNKS.values() if c}}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        engine = _serving_engine(front)
        _add_component(doc, ErrorResponse)
        _add_component(doc, AnthropicErrorResponse)
        for model in models.values():
            _add_component(doc, model)
        paths = doc["paths"]
        if engine is not None:
            if not engine.input_processor.embeddings:
                paths.pop("/v1/embeddings", None)
            if getattr(engine, "lora", None) is None:
                for path in LORA_PATHS:
                    paths.pop(path, None)
        for path, operations in paths.items():
            for method, op in operations.items():
                _describe_operation(method, path, op, api_key=api_key)
        if api_key:
            schemes = doc["components"].setdefault("securitySchemes", {})
            schemes["bearer"] = {"type": "http", "scheme": "bearer"}
            schemes["x_api_key"] = API_KEY_SCHEME      # the Messages routes' (Anthropic's header)
            for path, operations in paths.items():
                if path not in OPEN_PATHS:
                    for op in operations.values():
                        op["security"] = [{"bearer": []}]
        for path, operations in paths.items():
            for op in operations.values():
                describe_messages_operation(path, op, api_key=api_key)
        _link_stored_responses(paths)
        for name in ("HTTPValidationError", "ValidationError"):
            doc.get("components", {}).get("schemas", {}).pop(name, None)
        if engine is not None:
            _apply_limits(doc, engine, front.limits, reasoning=front.reasoning_parser is not None)
            app.openapi_schema = doc      # the engine's facts are final: built once
        return doc

    app.openapi = openapi


def _link_stored_responses(paths: dict) -> None:
    """A created response's id leads to the routes of a stored response (OpenAPI links: a client
    generator, and schemathesis' stateful phase, follow them)."""
    create = paths.get("/v1/responses", {}).get("post")
    if create is None:
        return
    links = {}
    for path, operations in paths.items():
        if path.startswith("/v1/responses/{response_id}"):
            for method, op in operations.items():
                links[op["operationId"]] = {"operationId": op["operationId"],
                                            "parameters": {"response_id": "$response.body#/id"}}
    create["responses"]["200"]["links"] = links


def _serving_engine(front):
    aengine = front.state.aengine
    if front.state.phase is not Phase.SERVING or aengine is None:
        return None
    return aengine.engine


def _add_component(doc: dict, model) -> None:
    _add_component_to(doc.setdefault("components", {}).setdefault("schemas", {}), model)


def _add_component_to(components: dict, model, mode: str = "serialization") -> None:
    if model.__name__ in components:
        return
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode=mode)
    defs = schema.pop("$defs", {})
    for name, d in defs.items():
        components.setdefault(name, d)
    components[model.__name__] = schema


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _describe_operation(method: str, path: str, op: dict, *, api_key: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    codes = set()
    if op.get("parameters") or op.get("requestBody"):
        codes.add(400)
    if op.get("requestBody"):
        codes |= {408, 413}
    if api_key and path not in OPEN_PATHS:
        codes.add(401)
    if path in NOT_FOUND_PATHS or path in GENERATION_PATHS:
        codes.add(404)
    if path in GENERATION_PATHS:
        codes.add(429)
    if path not in ("/metrics", "/openapi.json"):
        codes.add(503)
    for code in sorted(codes):
        responses[str(code)] = _error(_STATUS[code])
    for param in op.get("parameters", ()):
        schema = QUERY_PARAMETERS.get((path, param["name"]))
        if schema is not None:
            param["schema"] = copy.deepcopy(schema)
    if path in CONFLICTS:
        responses["409"] = _error(CONFLICTS[path])
    ok = responses.setdefault("200", {"description": "OK"})
    model = RESPONSE_MODELS.get((method, path))
    if model is not None:
        ok["content"] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}
    if path in STREAMING_PATHS and method == "post":
        ok.setdefault("content", {})["text/event-stream"] = {"schema": _event_schema(STREAM_CHUNKS[path])}
    if path == "/health":
        ok.pop("content", None)
        ok["description"] = "serving (an empty body)"
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        ok["description"] = "the Prometheus metrics, in the text exposition format"
        responses["404"] = _error("metrics are off on this server")
    elif path in LORA_PATHS:
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}


def _apply_limits(doc: dict, engine, limits, *, reasoning: bool = False) -> None:
    """The engine's and this server's limits, and SamplingParams' ranges, into the request schemas
    (see the module doc); a field's schema here is the one the server enforces for it."""
    c = doc["components"]["schemas"]
    vocab = engine.vocab_size
    longest = engine.max_model_len - 1
    most_tokens = longest if limits.max_tokens is None else min(longest, limits.max_tokens)
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1, "maxItems": longest}
    text = {"type": "string", "minLength": 1}
    stops = {"type": "string", "minLength": 1, "maxLength": sp.MAX_STOP_STRING_CHARS}
    stop = _nullable({"anyOf": [stops, {"type": "array", "items": stops,
                                        "maxItems": min(sp.MAX_STOP_STRINGS, limits.max_stop_strings)}]})
    sampling = {
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "default": 1},
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": sp.MAX_TEMPERATURE}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": sp.MAX_INT32}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": {"type": "number", "minimum": -sp.MAX_PENALTY, "maximum": sp.MAX_PENALTY, "default": 0},
        "frequency_penalty": {"type": "number", "minimum": -sp.MAX_PENALTY, "maximum": sp.MAX_PENALTY, "default": 0},
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": sp.MAX_REPETITION_PENALTY,
                               "default": 1},
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": most_tokens, "default": 0},
        "stop": stop,
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "logit_bias": _nullable({"type": "object", "maxProperties": sp.MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": token_id_pattern(vocab)},
                                 "additionalProperties": {"type": "number", "minimum": -sp.MAX_ABS_LOGIT_BIAS,
                                                          "maximum": sp.MAX_ABS_LOGIT_BIAS}}),
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": sp.MAX_LOGPROBS}),
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": sp.MAX_LOGPROBS}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": sp.MAX_LOGPROBS}),
    }
    max_tokens = _nullable({"type": "integer", "minimum": 1, "maximum": most_tokens})
    _set(c, "CompletionRequest", sampling, max_tokens=_nullable({"type": "integer", "minimum": 0,
                                                                 "maximum": most_tokens}),
         prompt={"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": limits.max_prompts},
                           token_ids,
                           {"type": "array", "items": token_ids, "minItems": 1, "maxItems": limits.max_prompts}]})
    _set(c, "ChatCompletionRequest", {k: v for k, v in sampling.items() if k != "logprobs"},
         max_tokens=max_tokens, max_completion_tokens=max_tokens)
    _set(c, "ResponsesRequest", {k: v for k, v in sampling.items()
                                 if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
                                          "top_logprobs")},
         max_output_tokens=max_tokens)
    _describe_responses_request(c)
    describe_messages_requests(c, set_fields=lambda comps, model, **fields: _set(comps, model, {}, **fields),
                               ref=lambda model: _ref(c, model), stop=stops,
                               max_stops=min(sp.MAX_STOP_STRINGS, limits.max_stop_strings), most_tokens=most_tokens,
                               reasoning=reasoning)
    tool_name = {"type": "string", "pattern": f"^{TOOL_NAME.pattern}$"}
    _set(c, "FunctionDefinition", {}, name=tool_name)
    _set(c, "FunctionTool", {}, name=tool_name)
    choice = _nullable({"anyOf": [
        {"type": "string", "enum": ["auto", "required", "none"]},
        {"type": "object", "required": ["type", "function"],
         "properties": {"type": {"const": "function"},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string", "minLength": 1}}}}},
        {"type": "object", "required": ["type", "name"],     # the Responses API's flat form
         "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1},
                        "function": {"type": "null"}}}]})
    _set(c, "ChatCompletionRequest", {}, tool_choice=choice)
    _set(c, "ResponsesRequest", {}, tool_choice=_nullable({"anyOf": [choice["anyOf"][0]["anyOf"][0],
                                                                     choice["anyOf"][0]["anyOf"][2]]}))
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    if "ChatMessage" in c:
        # other fields are ignored only when null or empty (http/request_checks.py)
        c["ChatMessage"]["additionalProperties"] = {"enum": [None, "", [], {}]}
    _set(c, "ChatMessage", {}, content=_nullable({"anyOf": [{"type": "string"},
                                                            {"type": "array", "items": text_part}]}))
    _describe_structured_outputs(c)
    if not engine.input_processor.prompt_logprobs:
        _set(c, "CompletionRequest", {}, prompt_logprobs={"type": "null"})
    _set(c, "CompletionRequest", {}, suffix={"type": "null"})     # no fill-in-the-middle
    template = getattr(engine.tokenizer, "chat_template", None)
    _set(c, "ChatMessage", {}, role={"type": "string", "enum": sorted(chat_roles(template))})
    _set(c, "EmbeddingRequest", {}, input={"anyOf": [
        text, {"type": "array", "items": text, "minItems": 1, "maxItems": limits.max_embedding_inputs},
        token_ids, {"type": "array", "items": token_ids, "minItems": 1, "maxItems": limits.max_embedding_inputs}]},
        dimensions=_nullable({"type": "integer", "const": engine.runner.model_config.hidden_size}))
    _set(c, "DetokenizeRequest", {}, tokens={"type": "array", "items": token_id, "maxItems": engine.max_model_len})


def _describe_structured_outputs(c: dict) -> None:
    """vLLM's structured_outputs sets exactly one kind (structured_outputs.py); OpenAI's
    response_format and Responses' text.format need a schema with type json_schema."""
    text = _nullable({"type": "string", "minLength": 1})
    _set(c, "StructuredOutputsField", {}, regex=text, grammar=text,
         choice=_nullable({"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}),
         json=_nullable({"anyOf": [{"type": "object"}, {"type": "string"}]}),
         json_object=_nullable({"type": "boolean"}))
    if "StructuredOutputsField" in c:
        set_ = {"type": ["string", "object", "array", "boolean", "number", "integer"]}   # present, not null
        c["StructuredOutputsField"]["oneOf"] = [
            {"required": ["json"], "properties": {"json": set_}},
            {"required": ["json_object"], "properties": {"json_object": {"const": True}}},
            {"required": ["regex"], "properties": {"regex": set_}},
            {"required": ["choice"], "properties": {"choice": set_}},
            {"required": ["grammar"], "properties": {"grammar": set_}}]
    for model, inner in (("ResponseFormat", "json_schema"), ("TextFormat", None)):
        if model not in c:
            continue
        need = ({"required": [inner], "properties": {inner: {"type": "object", "required": ["schema"],
                                                             "properties": {"schema": {"type": "object"}}}}}
                if inner else {"required": ["schema"], "properties": {"schema": {"type": "object"}}})
        c[model]["allOf"] = [{"if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
                              "then": need}]


def _describe_responses_request(c: dict) -> None:
    """The Responses fields this server knows and refuses (http/responses_input.py) as the values
    it takes: none at all, or the few it serves; its input items and their parts, which the route
    validates one at a time, as the models it validates them with."""
    from jaxserve.server.http import responses_schemas as rs
    from jaxserve.server.http.responses_input import LOGPROBS_INCLUDE, REFUSED_FIELDS, TEXT_PARTS

    def ref(model) -> dict:
        return _ref(c, model)

    parts = {"type": "array", "items": {"anyOf": [ref(m) for m in TEXT_PARTS.values()]}}
    items = [ref(m) for m in (rs.MessageItem, rs.FunctionCallItem, rs.FunctionCallOutputItem, rs.ReasoningInputItem)]
    _set(c, "MessageItem", {}, content={"anyOf": [{"type": "string"}, parts]})
    _set(c, "FunctionCallOutputItem", {}, output={"anyOf": [{"type": "string"}, parts]})
    _set(c, "ReasoningInputItem", {}, summary=parts, content=_nullable(parts))
    _set(c, "ResponsesRequest", {}, input={"anyOf": [{"type": "string"},
                                                     {"type": "array", "minItems": 1, "items": {"anyOf": items}}]},
         tools=_nullable({"type": "array", "items": ref(rs.FunctionTool)}))

    nothing = {"type": "null"}
    _set(c, "ResponsesRequest", dict.fromkeys(REFUSED_FIELDS, nothing),
         background=_nullable({"type": "boolean", "enum": [False]}),
         truncation=_nullable({"type": "string", "enum": ["disabled"]}),
         service_tier=_nullable({"type": "string", "enum": ["auto", "default"]}),
         include=_nullable({"type": "array", "items": {"type": "string", "enum": [LOGPROBS_INCLUDE]}}),
         reasoning=_nullable({"type": "object", "additionalProperties": nothing}))
    _set(c, "TextConfig", {}, verbosity=_nullable({"type": "string", "enum": ["medium"]}))
    _set(c, "ResponsesStreamOptions", {}, include_obfuscation=_nullable({"type": "boolean", "enum": [False]}))


def _ref(components: dict, model) -> dict:
    """A request part the route validates itself, as a component of the validating model."""
    _add_component_to(components, model, "validation")
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _set(components: dict, model: str, fields: dict, **more) -> None:
    props = components.get(model, {}).get("properties")
    if props is None:
        return
    for field, schema in {**fields, **more}.items():
        if field in props:
            props[field] = copy.deepcopy(schema)


def token_id_pattern(vocab_size: int) -> str:
    """A regex of the decimal token ids 0 .. vocab_size - 1 (leading zeros allowed, as int() reads
    them): logit_bias keys are JSON object keys, so strings."""
    top = str(vocab_size - 1)
    shorter = [r"[0-9]"] + [rf"[1-9][0-9]{{{k - 1}}}" for k in range(2, len(top))]
    same = []
    for i, ch in enumerate(top):
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(ch) > low:
            tail = len(top) - i - 1
            same.append(top[:i] + f"[{low}-{int(ch) - 1}]" + (rf"[0-9]{{{tail}}}" if tail else ""))
    same.append(top)
    alternatives = (shorter if len(top) > 1 else []) + same
    return "^0*(" + "|".join(dict.fromkeys(alternatives)) + ")$"


def _nullable(schema: dict) -> dict:
    return {"anyOf": [copy.deepcopy(schema), {"type": "null"}]}
