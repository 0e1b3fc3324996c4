"""An HTTP request's fields -> the engine's SamplingParams and prompts.

SamplingParams validates every value itself (its ValueError names the field, which becomes the
400's `param`); here are only what the HTTP API adds: OpenAI's defaults and spellings, the
server's per-request limits (the same RequestCaps the gRPC front enforces) and the fields this
engine does not have.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.refusals import ConflictingFields, InvalidJSONText
from jaxserve.sampling_params import OutputKind, SamplingParams
from jaxserve.structured_outputs import StructuredOutputs
from jaxserve.tool_parsers.plan import NO_TOOLS, ToolPlan
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.http.errors import bad_request, refused
from jaxserve.server.http.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields


CONFLICT = ConflictingFields.code     # valid fields refused together: the 400's code


def completion_params(req: CompletionRequest, limits: RequestCaps) -> SamplingParams:
    """With echo and logprobs, the prompt's logprobs are asked too (the echoed prompt's entries);
    max_tokens 0 with echo runs one token (the engine samples at least one) that the answer drops."""
    if req.suffix is not None:
        raise bad_request("suffix is not supported (no fill-in-the-middle)", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} is not supported; only best_of=n", "best_of", CONFLICT)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 asks for nothing; it is allowed with echo=true (the prompt alone)",
                          "max_tokens", CONFLICT)
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available when stream=true (echo with logprobs is)",
                          "prompt_logprobs", CONFLICT)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    return _params(req, limits, max_tokens=1 if echo_only(req) else req.max_tokens, logprobs=req.logprobs,
                   logprobs_field="logprobs", prompt_logprobs=prompt_logprobs,
                   prompt_logprobs_field="prompt_logprobs" if req.prompt_logprobs is not None else "logprobs")


def echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the answer is the prompt alone."""
    return req.echo and req.max_tokens == 0


def chat_params(req: ChatCompletionRequest, limits: RequestCaps, tools: ToolPlan = NO_TOOLS) -> SamplingParams:
    """tools: the request's tool plan (http/chat_tools.py), whose constraint (tool_choice required
    or a named function) and special-token setting the params take."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs", CONFLICT)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    return _params(req, limits, max_tokens=max_tokens, logprobs=logprobs, logprobs_field="top_logprobs",
                   max_tokens_field=field, constraint=tools.structured_outputs,
                   skip_special_tokens=tools.skip_special_tokens)


def _params(req: _SamplingFields, limits: RequestCaps, *, max_tokens: int | None, logprobs: int | None,
            logprobs_field: str, max_tokens_field: str = "max_tokens", prompt_logprobs: int | None = None,
            prompt_logprobs_field: str = "prompt_logprobs", constraint: StructuredOutputs | None = None,
            skip_special_tokens: bool | None = None) -> SamplingParams:
    if req.n > limits.max_n:
        raise bad_request(f"n={req.n} exceeds this server's limit of {limits.max_n}", "n")
    if req.stream_options is not None and not req.stream:   # OpenAI refuses it too: it would do nothing
        raise bad_request("stream_options is only allowed with stream=true", "stream_options", CONFLICT)
    if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
        raise bad_request(f"{max_tokens_field}={max_tokens} exceeds this server's limit of {limits.max_tokens}",
                          max_tokens_field)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop is not None and len(stop) > limits.max_stop_strings:
        raise bad_request(f"stop has {len(stop)} strings; the limit is {limits.max_stop_strings}", "stop")
    kwargs: dict[str, Any] = dict(
        structured_outputs=constraint if constraint is not None else _structured_outputs(req),
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, logit_bias=_logit_bias(req.logit_bias),
        n=req.n, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        stop=tuple(stop) if stop else None, logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, output_kind=OutputKind.DELTA,
        stop_token_ids=tuple(req.stop_token_ids) if req.stop_token_ids else None, prompt_logprobs=prompt_logprobs)
    for name in ("temperature", "top_p", "top_k", "min_p"):   # None: the engine's default (OpenAI's too)
        if getattr(req, name) is not None:
            kwargs[name] = getattr(req, name)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        message = str(e)
        param = _field_of(message)
        if param == "structured_outputs" and req.structured_outputs is None:
            param = "response_format"
        if param == "logprobs":
            param = logprobs_field
        elif param == "prompt_logprobs":
            param = prompt_logprobs_field
        elif param == "max_tokens":
            param = max_tokens_field
        raise refused(e, param) from e


def _structured_outputs(req: _SamplingFields) -> StructuredOutputs | None:
    """response_format (OpenAI) or structured_outputs (vLLM), not both; the grammar is compiled and
    checked at the engine's door, whose error names the problem."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise bad_request("set response_format or structured_outputs, not both", "structured_outputs", CONFLICT)
    try:
        if so is not None:
            return StructuredOutputs(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                     json_object=bool(so.json_object))
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputs(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required for type json_schema",
                              "response_format")
        return StructuredOutputs(json=rf.json_schema.schema_)
    except ValueError as e:
        raise refused(e, "structured_outputs" if so is not None else "response_format") from e


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias has token ids as JSON object keys, so as strings."""
    if not bias:
        return None
    # decimal digits only (int() would also read " 5", "+5" and "5_0"): the schema's pattern
    bad = [k for k in bias if not (k.isascii() and k.isdigit())]
    if bad:
        raise bad_request(f"logit_bias keys must be token ids in decimal, got {sorted(bad)[:5]}", "logit_bias")
    return {int(k): v for k, v in bias.items()}


def _field_of(message: str) -> str | None:
    prefix = "SamplingParams."
    return message[len(prefix):].split("=", 1)[0] if message.startswith(prefix) else None


def completion_prompts(req: CompletionRequest) -> list[dict[str, Any]]:
    """`prompt` as the engine's prompts: a string, a list of strings, token ids or lists of them."""
    p = req.prompt
    if isinstance(p, str):
        prompts = [{"prompt": p}]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [{"prompt_token_ids": list(p)}]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [{"prompt": x} for x in p]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [{"prompt_token_ids": list(x)} for x in p]
    else:
        raise bad_request("prompt must be a non-empty string, list of strings, token ids or lists of token ids",
                          "prompt")
    if req.cache_salt is not None:
        for q in prompts:
            q["cache_salt"] = req.cache_salt
    return prompts


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template's dicts; content parts must be text (no images here). An
    assistant's tool calls go with their arguments as objects (what templates write back with
    tojson), a tool result with its tool_call_id, a reasoning as reasoning_content (the name
    templates read) and reasoning."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported "
                                      f"(got type {part.get('type')!r})", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{k}]")
                                 for k, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        out.append(msg)
    return out


def _template_call(call, field: str) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad_request(f"{field}.function.arguments is not valid JSON: {e}", field, InvalidJSONText.code) from None
    if not isinstance(args, dict):
        raise bad_request(f"{field}.function.arguments must be a JSON object", field, InvalidJSONText.code)
    out: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out
