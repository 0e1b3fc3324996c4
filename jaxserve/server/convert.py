"""Between the wire and the engine: GenerateRequest -> (prompt, SamplingParams), RequestOutput ->
GenerateResponse, EngineStats -> ServerInfo.

Proto3 `optional` fields keep the engine's defaults: only fields the client set are passed to
SamplingParams, so an unset temperature stays 1.0 rather than proto's 0. Every bad value becomes a
ValueError naming the field, which the servicer turns into INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from typing import Any

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import OutputKind, SamplingParams
from jaxserve.proto import generation_pb2 as pb
from jaxserve.server.request_caps import RequestCaps
from jaxserve.server.sample_deltas import SampleDelta
from jaxserve.structured_outputs import StructuredOutputs

# proto field -> SamplingParams field, for the optional scalars
_SCALARS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos",
            "skip_special_tokens", "include_stop_str_in_output", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "prompt_logprobs")


def sampling_params_from_proto(msg: pb.SamplingParams, limits: RequestCaps = RequestCaps()) -> SamplingParams:
    kwargs: dict[str, Any] = {name: getattr(msg, name) for name in _SCALARS if msg.HasField(name)}
    if msg.stop:
        kwargs["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    n = kwargs.get("n", 1)
    if n > limits.max_n:
        raise ValueError(f"SamplingParams.n={n} exceeds this server's limit of {limits.max_n}")
    mt = kwargs.get("max_tokens")
    if limits.max_tokens is not None and mt is not None and mt > limits.max_tokens:
        raise ValueError(f"SamplingParams.max_tokens={mt} exceeds this server's limit of {limits.max_tokens}")
    if len(msg.stop) > limits.max_stop_strings:
        raise ValueError(f"SamplingParams.stop has {len(msg.stop)} strings; the limit is {limits.max_stop_strings}")
    # the stream sends what is new; the engine's DELTA outputs are exactly that
    return SamplingParams(output_kind=OutputKind.DELTA, **kwargs)


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputs:
    which = msg.WhichOneof("kind")
    if which is None:
        raise ValueError("SamplingParams.structured_outputs is empty: set one of json_schema, json_object, "
                         "regex, choice, grammar")
    if which == "json_schema":
        return StructuredOutputs(json=msg.json_schema)
    if which == "choice":
        return StructuredOutputs(choice=tuple(msg.choice.choices))
    return StructuredOutputs(**{which: getattr(msg, which)})


def chat_messages(msg: pb.Chat) -> list[dict[str, Any]]:
    """The proto's messages as the chat template's dicts; roles are checked when the chat is
    rendered (chat_prompt.render_chat), against the roles the model's template takes. Calls,
    tool results and reasoning as the HTTP route hands them (http/sampling.py chat_messages)."""
    out = []
    for i, m in enumerate(msg.messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [_template_call(c, f"chat.messages[{i}].tool_calls[{k}]")
                               for k, c in enumerate(m.tool_calls)]
        for name in ("tool_call_id", "name"):
            if m.HasField(name):
                d[name] = getattr(m, name)
        if m.HasField("reasoning"):
            d["reasoning_content"] = d["reasoning"] = m.reasoning
        out.append(d)
    return out


def _template_call(c: pb.ToolCall, field: str) -> dict[str, Any]:
    try:
        args = json.loads(c.arguments) if c.arguments.strip() else {}
    except ValueError as e:
        raise ValueError(f"{field}.arguments is not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{field}.arguments must be a JSON object")
    call: dict[str, Any] = {"type": "function", "function": {"name": c.name, "arguments": args}}
    if c.id:
        call["id"] = c.id
    return call


def prompt_from_proto(req: pb.GenerateRequest) -> Any:
    """The engine's prompt for a text or token-id input; a chat needs the tokenizer (see servicer)."""
    which = req.WhichOneof("input")
    if which is None:
        raise ValueError("GenerateRequest.input is missing: set text, token_ids or chat")
    salt = req.cache_salt if req.HasField("cache_salt") else None
    if which == "text":
        prompt: dict[str, Any] = {"prompt": req.text}
    elif which == "token_ids":
        prompt = {"prompt_token_ids": list(req.token_ids.ids)}
    else:
        raise ValueError("chat input needs the chat template (prompt_from_proto handles text and token_ids)")
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def complete_response(out: RequestOutput, d: SampleDelta) -> pb.GenerateResponse:
    """The Complete message of a sample's last delta."""
    return pb.GenerateResponse(request_id=out.request_id, complete=pb.Complete(
        finish_reason=d.finish_reason or "stop", stop_reason="" if d.stop_reason is None else str(d.stop_reason),
        prompt_tokens=len(out.prompt_token_ids), completion_tokens=d.num_tokens, cached_tokens=out.num_cached_tokens,
        index=d.index))


def prompt_logprobs_to_proto(out: RequestOutput, k: int) -> list[pb.PromptLogprob]:
    """RequestOutput.prompt_logprobs as the Chunk's entries: one per prompt token after the first,
    with its k top alternatives best first (an entry holds those, ranks 1..k, and the prompt token)."""
    entries = []
    for tid, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k)
        entries.append(pb.PromptLogprob(token_id=tid, logprob=entry[tid].logprob, rank=entry[tid].rank or 0,
                                        top=[pb.TopLogprob(token_id=t, logprob=lp) for _, t, lp in top]))
    return entries


def server_info(stats, *, active_streams: int, state: str) -> pb.ServerInfo:
    """The gRPC ServerInfo of an EngineStats (engine/stats.py): its wire fields stay flat."""
    sched, steps, requests, mesh = stats.scheduler, stats.steps, stats.requests, stats.mesh
    return pb.ServerInfo(
        num_kv_blocks_total=sched.num_kv_blocks_total, num_kv_blocks_free=sched.num_kv_blocks_free,
        num_kv_blocks_cached=sched.num_kv_blocks_cached, num_requests_running=sched.num_running,
        num_requests_waiting=sched.num_waiting, num_preemptions=sched.num_preemptions,
        num_compilations_after_warmup=max(0, steps.num_compilations_after_warmup), uptime_s=stats.lifecycle.uptime_s,
        prompt_tokens_total=requests.prompt_tokens_total, generation_tokens_total=requests.generation_tokens_total,
        num_requests_finished=requests.num_finished, kv_usage=sched.kv_usage,
        prefix_hit_rate=sched.prefix_hit_rate, active_streams=active_streams, state=state,
        mesh=pb.MeshInfo(num_devices=mesh.num_devices, num_hosts=mesh.num_hosts, axis_sizes=dict(mesh.axis_sizes)),
        weights_version=stats.weights.version, num_weight_updates=stats.weights.num_updates,
        paused=stats.lifecycle.paused, num_requests_held=requests.num_held)
