"""LLM: the offline Python API, in the shape of vLLM's.

    llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Tell me about tides."], SamplingParams(max_tokens=64))

Every constructor argument is a field of EngineConfig (and a flag of the CLI) but `mesh=` /
`mesh_axis=` (devices a caller owns, beside a trainer: docs/rl.md). A model defined outside
jaxserve is served the same way from its functions and params (docs/custom_models.md):

    llm = LLM(model=CustomModel(forward=..., compute_logits=..., ...), params=params, tokenizer=tok)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from jaxserve.engine_args import engine_config, per_engine_args, replace_args
from jaxserve.engine.builder import build_custom_engine, build_engine
from jaxserve.engine.stats import EngineStats
from jaxserve.embedding_outputs import EmbeddingRequestOutput
from jaxserve.outputs import RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import OutputKind, SamplingParams

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jaxserve.engine.control_plane import WeightUpdate
    from jaxserve.lora.request import LoRARequest
    from jaxserve.models.custom import CustomModel
    from jaxserve.runner.sleep import SleepReport, WakeUpReport


OFFLINE_PREFILL_TOKEN_THRESHOLD = 0   # no per-request cap: whole token budgets of prefill per step
# Serving defaults to 8-row prefill tiles, the floor of a chunk beside decodes (one 8-row tile at
# depth 2,048 adds 53 ms to a step of 16 decodes where a 16-row tile adds 90 ms); offline there is
# no one to protect, and a 512-token prefill step runs 10% faster in 16-row tiles (925 vs 1,031 ms).
OFFLINE_PREFILL_TILE = 16


class LLM:
    def __init__(self, model: "str | CustomModel | None" = None, *, params: Any = None, tokenizer: Any = None,
                 mesh: "Mesh | None" = None, mesh_axis: str | None = None, **kwargs: Any):
        """model: a checkpoint (GGUF file, HF directory, converted checkpoint; None: the embedded
        model), or a CustomModel, served from `params` (its pytree of jax.Arrays) with `tokenizer`
        (a transformers tokenizer); both are required for a CustomModel and refused otherwise.
        mesh: a jax.sharding.Mesh (or sub-mesh) the caller owns, e.g. beside a trainer: the model
        is split over its `mesh_axis` (default "model", or a 1-D mesh's axis) and lives on those
        devices only; tensor_parallel_size is that axis's size (parallel/mesh.py `engine_mesh`)."""
        from jaxserve.models.custom import CustomModel

        progress = kwargs.pop("progress", True)
        # LLM.chat's defaults (not engine settings): the model's call format and its reasoning's
        self.tool_call_parser = kwargs.pop("tool_call_parser", None)
        self.reasoning_parser = kwargs.pop("reasoning_parser", None)
        custom = isinstance(model, CustomModel)
        if not custom and (params is not None or tokenizer is not None):
            raise ValueError("params= and tokenizer= are for a model defined outside jaxserve "
                             "(model=jaxserve.CustomModel(...)); a checkpoint brings its own")
        # Offline batches have no one waiting between tokens, so by default LLM does not cap
        # prefill chunks for inter-token latency (as vLLM's LLM class takes bigger batches than
        # its server); pass long_prefill_token_threshold=None for the serving default, derived
        # from an ITL budget at start-up (engine/chunk_policy.py).
        kwargs.setdefault("long_prefill_token_threshold", OFFLINE_PREFILL_TOKEN_THRESHOLD)
        kwargs.setdefault("prefill_tile", OFFLINE_PREFILL_TILE)
        if mesh is not None:
            mesh = _caller_mesh(mesh, mesh_axis, kwargs)
        elif mesh_axis is not None:
            raise ValueError("mesh_axis= names an axis of mesh=, which was not given")
        if custom:
            # the config names no checkpoint: the model is the one handed over here
            self.config = engine_config(model=None, **kwargs)
            self.engine = build_custom_engine(self.config, model, params, tokenizer, progress=progress, mesh=mesh)
        else:
            self.config = engine_config(model=model, **kwargs)
            self.engine = build_engine(self.config, progress=progress, mesh=mesh)
        self.custom_model = model if custom else None

    @classmethod
    def sharing_runner(cls, other: "LLM", **overrides: Any) -> "LLM":
        """A second LLM on `other`'s compiled runner and KV arena with a fresh scheduler whose
        knobs come from `overrides` (e.g. usable_kv_blocks): no load, no compile."""
        allowed = per_engine_args()        # what the runner's shapes and weights do not depend on
        if set(overrides) - allowed:
            raise ValueError(f"sharing a runner can only change {sorted(allowed)}, "
                             f"not {sorted(set(overrides) - allowed)}")
        llm = cls.__new__(cls)
        llm.custom_model = getattr(other, "custom_model", None)
        llm.config = replace_args(other.config, **overrides)
        llm.engine = build_engine(llm.config, share_runner_of=other.engine)
        return llm

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, priority: int | Sequence[int] = 0,
                 lora_request: "LoRARequest | Sequence[LoRARequest | None] | None" = None) -> list[RequestOutput]:
        """Run prompts to completion; returns one RequestOutput per prompt, in input order.

        prompts: a string, a dict ({"prompt": str} or {"prompt_token_ids": [...]}, optionally
        "cache_salt"), or a list of those. sampling_params: one for all, or one per prompt.
        lora_request: the LoRA adapter for all prompts, or one per prompt (None: the base model);
        needs enable_lora=True.
        """
        return self._submit(prompts, sampling_params, priority, use_tqdm, "sampling_params", SamplingParams(),
                            lora_request)

    def _submit(self, prompts, params, priority, use_tqdm: bool, params_name: str, default_params,
                lora_request=None) -> list:
        """Queue every prompt with its params (SamplingParams, or PoolingParams for embeddings) and
        run them to completion; a bad prompt rejects the whole call."""
        if self.engine.paused or self.engine.pausing:
            raise RuntimeError("the engine is paused: call resume() before generating")
        if self.engine.asleep:
            raise RuntimeError("the engine is asleep: call wake_up() before generating")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        n = len(prompts)
        params = self._per_prompt(params, n, params_name, default_params)
        if params_name == "sampling_params":
            params = _final_only(params)
        priorities = self._per_prompt(priority, n, "priority", 0)
        loras = self._per_prompt(lora_request, n, "lora_request", None)
        ids = []
        try:
            for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                ids.append(self.engine.add_request(None, prompt, p, priority=prio, lora_request=lora))
        except Exception:
            self.engine.abort(ids)   # a bad prompt rejects the whole call; nothing stays queued
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts, pooling: str = "last", normalize: bool = True, *,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, priority: int | Sequence[int] = 0) -> list[EmbeddingRequestOutput]:
        """Embed prompts (as for generate): one EmbeddingRequestOutput per prompt, in input order,
        its `outputs.embedding` the prompt's final hidden states pooled ("last" token or "mean"),
        unit-normalized unless normalize=False. pooling_params: one PoolingParams for all or one
        per prompt, instead of pooling and normalize. Needs enable_embeddings=True."""
        if pooling_params is None:
            pooling_params = PoolingParams(pooling=pooling, normalize=normalize)
        return self._submit(prompts, pooling_params, priority, use_tqdm, "pooling_params", PoolingParams())

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, tools: Sequence[dict] | None = None, tool_choice: Any = None,
             parallel_tool_calls: bool = True, tool_call_parser: str | None = None,
             reasoning_parser: str | None = None, chat_template_kwargs: dict | None = None,
             lora_request: "LoRARequest | Sequence[LoRARequest | None] | None" = None) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts, assistant messages
        with "tool_calls" and "tool" messages as transformers' templates take them) or a list of them.

        tools (OpenAI's `[{"type": "function", "function": {...}}]`), tool_choice ("auto",
        "required", "none" or {"type": "function", "function": {"name": ...}}) and
        parallel_tool_calls work as on /v1/chat/completions (jaxserve/tool_parsers/plan.py).
        tool_call_parser and reasoning_parser default to the LLM's (LLM(..., tool_call_parser=...));
        the tool parser then to the model's format. With tools or a reasoning parser each
        CompletionOutput's `message` holds the answer split into reasoning, content and tool calls."""
        from jaxserve.chat_output import ChatOutputSpec
        from jaxserve.reasoning_parsers import reasoning_parser as reasoning_parser_named
        from jaxserve.tool_parsers import ToolChoice, function_tools, plan_tools, resolve_tool_parser

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        function = function_tools(tools)
        choice = ToolChoice.from_openai(tool_choice)
        parser = None
        if function and (choice is None or choice.mode != "none"):
            model_type = getattr(getattr(self.engine.runner, "model_config", None), "model_type", None)
            parser = resolve_tool_parser(tool_call_parser or getattr(self, "tool_call_parser", None), tok, model_type)
        plan = plan_tools(function, choice, parallel_tool_calls=parallel_tool_calls, parser=parser, tokenizer=tok,
                          chat_template=chat_template)
        reasoning = reasoning_parser or getattr(self, "reasoning_parser", None)
        spec = ChatOutputSpec(plan.parser, reasoning_parser_named(reasoning) if reasoning is not None else None)
        prompts, opens = [], []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          chat_template=chat_template, **plan.template_kwargs,
                                          **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
            # a constrained call is written from the first token, never inside an opened reasoning
            opens.append(plan.structured_outputs is None and spec.prompt_opens_reasoning(tok, list(ids)))
        if plan.structured_outputs is not None or plan.skip_special_tokens is not None:
            changes: dict[str, Any] = {}
            if plan.structured_outputs is not None:
                changes["structured_outputs"] = plan.structured_outputs
            if plan.skip_special_tokens is not None:
                changes["skip_special_tokens"] = plan.skip_special_tokens
            given = sampling_params if sampling_params is not None else SamplingParams()
            if plan.structured_outputs is not None and any(
                    p.structured_outputs is not None for p in (given if isinstance(given, (list, tuple)) else [given])):
                raise ValueError("tool_choice 'required' or a named function constrains the answer to tool calls; "
                                 "it cannot be combined with SamplingParams.structured_outputs")
            sampling_params = ([dataclasses.replace(p, **changes) for p in given] if isinstance(given, (list, tuple))
                               else dataclasses.replace(given, **changes))
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        if spec.active:
            for out, opened in zip(outs, opens):
                for o in out.outputs:
                    o.message = spec.new(opened).parse(o.text)
        return outs

    def beam_search(self, prompts, params) -> list:
        """Beam search (see jaxserve/beam_search.py); prompts as for generate, params a
        BeamSearchParams. Returns BeamSearchOutputs with the best beam_width sequences each."""
        from jaxserve.beam_search import beam_search

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return beam_search(self, list(prompts), params)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            # past the last output too: the one-step-ahead loop may still have a step in flight
            while len(done) < len(ids) or self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    missing = sorted(wanted - set(done))
                    raise RuntimeError(f"requests {missing[:5]} vanished without finishing")
        except BaseException:
            self.engine.abort([i for i in ids if i not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    @staticmethod
    def _per_prompt(value, n: int, name: str, default):
        if value is None:
            return [default] * n
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    # -- weights and pause (docs/rl.md) ------------------------------------------------------
    # -- LoRA adapters (enable_lora=True; Engine.add_lora and friends) ------------------------
    def add_lora(self, lora_request: "LoRARequest") -> bool:
        """Register an adapter (a PEFT directory) on the host; False: registered already."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, name_or_id: str | int) -> bool:
        return self.engine.remove_lora(name_or_id)

    def list_loras(self) -> list["LoRARequest"]:
        return self.engine.list_loras()

    def update_weights(self, params: Any, *, version: int | str | None = None) -> "WeightUpdate":
        """Serve new weights in place, without a restart or a compile: `params` is a pytree with
        the structure, shapes and dtypes of `engine.runner.params` (placed onto the engine's
        shardings: a leaf already there is used as it is), or an iterable of (checkpoint tensor
        name, array) pairs, a subset of the checkpoint's tensors (jaxserve/engine/weight_update.py).
        The prefix cache is flushed; nothing cached under the old weights is served again."""
        return self.engine.update_weights(params, version=version)

    @property
    def weights_version(self) -> int | str | None:
        """The version the last update_weights named (None before any, or when it named none)."""
        return self.engine.weights_version

    def pause(self, mode: str = "abort") -> list[str]:
        """Pause the engine (Engine.pause): offline, between generate calls, "abort" and "keep"
        hold nothing (generate returns only when its requests are done); generate refuses while
        paused. Returns the ids of the requests aborted."""
        aborted = self.engine.pause(mode)
        if mode == "wait":   # offline nothing runs between calls: waiting means stepping to the end
            while self.engine.pausing:
                self.engine.step()
        return aborted

    def resume(self) -> None:
        failed = self.engine.resume()
        if failed:
            raise failed[0][1]

    # -- colocating with a trainer: sleep and wake up (docs/rl.md) ---------------------------
    def sleep(self, level: int = 1) -> "SleepReport":
        """Give the devices' memory to a colocated trainer until wake_up(), between generate calls:
        level 0 frees the KV arena only, 1 (vLLM's default) also moves the weights to host memory,
        2 drops the weights (update_weights(params) must bring them before wake_up). The prefix
        cache is flushed. Returns the bytes released (jaxserve/runner/sleep.py SleepReport)."""
        return self.engine.sleep(level)

    def wake_up(self) -> "WakeUpReport":
        """Take the arena and weights back; nothing compiles. Returns the bytes taken back."""
        return self.engine.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.engine.asleep

    # -- introspection -----------------------------------------------------------------------
    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def checkpoint_identity(self) -> str:
        return self.engine.checkpoint_identity


def _caller_mesh(mesh, axis: str | None, kwargs: dict):
    """The engine's mesh over a caller's (parallel/mesh.py `engine_mesh`); tensor_parallel_size
    follows it (a different one given is refused)."""
    from jaxserve.parallel.mesh import MODEL_AXIS, engine_mesh

    engine = engine_mesh(mesh, axis)
    size = engine.shape[MODEL_AXIS]
    asked = kwargs.setdefault("tensor_parallel_size", size)
    if asked != size:
        raise ValueError(f"tensor_parallel_size={asked} but the mesh's tensor-parallel axis has {size} devices "
                         f"(leave tensor_parallel_size out with mesh=: it follows the mesh)")
    return engine


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """The params as FINAL_ONLY (vLLM's LLM does the same): `generate` keeps only each request's
    finished output, so the engine builds no output per step for it (no cumulative copy of every
    output so far at every step), and params asking for DELTA still return the whole output, not
    its last chunk. One copy per distinct params object."""
    final = OutputKind.FINAL_ONLY
    copies: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        if isinstance(p, SamplingParams) and p.output_kind is not final:   # others: the engine refuses them
            q = copies.get(id(p))
            if q is None:
                q = copies[id(p)] = dataclasses.replace(p, output_kind=final)
            p = q
        out.append(p)
    return out
