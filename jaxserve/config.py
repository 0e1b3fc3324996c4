"""EngineConfig: every knob of the engine in one frozen dataclass, validated once.

`LLM(**kwargs)`, the CLI (`--max-num-seqs` <-> max_num_seqs) and the server are all built from
these fields, so the three front doors always agree. Each field's metadata holds its help text.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

from jaxserve.quant.spec import QUANTIZATION_MODES
from jaxserve.sched.speculation import SpeculativeConfig


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = _f(None, "GGUF file, HF directory or converted checkpoint; default: the embedded SmolLM2-135M-Instruct")
    dtype: str = _f("auto", "weights and KV cache dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16",
                    choices=("auto", "float32", "bfloat16"))
    quantization: str = _f(
        "none", "weight quantization of the decoder projections: none (serve the checkpoint as it is), int8 "
                "(per output channel), int4 (group-wise, --quantization-group-size), fp8 (e4m3 weights and "
                "activations, activation scales calibrated on real text), w8a8 (int8 weights and int8 activations "
                "per token, smoothed with per-channel ranges calibrated on real text: the fast form on CPUs); "
                "embedding, LM head and norms stay float (w8a8: see --quantize-lm-head)",
        choices=QUANTIZATION_MODES)
    quantize_lm_head: bool = _f(
        False, "w8a8: the LM head in int8 too (smoothed like the projections; a tied embedding keeps a float "
               "copy for the lookup): on a CPU the float head is a large part of a small model's decode step")
    quantization_group_size: int = _f(32, "int4: inputs per scale (32 or 128)")
    kv_cache_dtype: str = _f(
        "auto", "KV cache element type: auto (the model dtype), fp8_e4m3 or int8 (per-layer per-head scales "
                "calibrated on real text; half the bytes of bfloat16)", choices=("auto", "fp8_e4m3", "int8"))
    calibration_data: str | None = _f(
        None, "text file the fp8 activation scales, w8a8's smoothing and fp8/int8 KV cache scales are calibrated "
              "on (default: a built-in public-domain text)")
    max_model_len: int | None = _f(None, "longest prompt + output in tokens; default: the model's limit, at most 8192")
    block_size: int = _f(16, "tokens per KV block")
    max_num_seqs: int = _f(32, "most sequences in one step")
    max_num_batched_tokens: int = _f(512, "token budget of one step (prefill chunks + decodes)")
    kv_cache_memory: int | None = _f(None, "bytes for the KV arena (default 1 GiB unless num_kv_blocks is set)")
    num_kv_blocks: int | None = _f(None, "KV blocks in the arena (overrides kv_cache_memory)")
    usable_kv_blocks: int | None = _f(None, "cap on the blocks the scheduler may use (tests create pressure this way)")
    seed: int = _f(0, "seed for requests that bring none")
    enable_prefix_caching: bool = _f(True, "share KV blocks of common prompt prefixes")
    enable_chunked_prefill: bool = _f(True, "split long prompts into chunks across steps")
    long_prefill_token_threshold: int | None = _f(
        None, "most prompt tokens of one request per step (0: no cap; default: itl_budget_ms x the prefill "
              "tokens/s measured at start-up, applied only to steps that carry decodes; LLM defaults to 0)")
    ttft_slo_ms: float | None = _f(
        None, "time-to-first-token objective the prefill policy serves (default: derived at start-up, max(1 s, "
              "2 x a full-budget prefill step))")
    tpot_slo_ms: float | None = _f(
        None, "time-per-output-token objective: a step that carries decodes stays within 0.9 x it, unless a "
              "prompt's TTFT is at risk and every decoder has banked that time (default: derived at start-up, "
              "max(100 ms, 1.5 x a decode step of max_num_seqs))")
    chunk_policy: str = _f(
        "slo", "how prompt chunks are sized when long_prefill_token_threshold is not set: slo (to the TTFT and "
               "TPOT objectives by a step-time model measured at start-up) or itl (the earlier policy: one fixed "
               "chunk per decode bucket from an ITL budget, one prompt mid-prefill at a time)",
        choices=("slo", "itl"))
    itl_budget_ms: float | None = _f(
        None, "chunk_policy=itl: time a step may add for prefill chunks while decodes wait, from which the chunk "
              "size is derived (default: the measured decode-only step time of the decode batch beside the chunk, "
              "one per decode bucket, i.e. a long prompt at most doubles the inter-token latency)")
    prefill_tile: int = _f(8, "query rows per prefill attention tile: the smallest prefill chunk a step carries "
                               "beside decodes (LLM defaults to 16: bulk prefill runs faster in bigger tiles)")
    decode_buckets: tuple[int, ...] | None = _f(
        None, "compiled decode rows of steps with prefill tiles (default: 1, 4, 16, ... max_num_seqs)")
    decode_only_buckets: tuple[int, ...] | None = _f(
        None, "compiled decode rows of decode-only steps (default: decode_buckets if those are set, else "
              "1, 2, 4, 6, 8, 12, 16, 24, 32, 48, ... max_num_seqs)")
    prefill_buckets: tuple[int, ...] | None = _f(None, "compiled prefill tile counts (default: 0, 1, 2, 4, ... max)")
    max_num_partial_prefills: int = _f(1, "most prompts left mid-prefill after a step (0: no cap)")
    starvation_steps: int = _f(32, "a request waiting this many steps is never overtaken again")
    scheduling_policy: str = _f("fcfs", "fcfs, or priority (lower value = more urgent)", choices=("fcfs", "priority"))
    priority_weight_base: float = _f(2.0, "priority policy: class p gets a fair share of weight base ** -p")
    max_waiting_requests: int = _f(0, "beyond this many requests waiting for a seat (requests that free seats "
                                      "will take at the next step do not count) new ones get Overloaded "
                                      "(0: unbounded)")
    kv_watermark: float = _f(0.01, "share of KV blocks admissions leave free for running requests")
    preemption_mode: str = _f("auto", "recompute, swap (to host memory), or auto (by a cost model measured at start-up)",
                              choices=("auto", "recompute", "swap"))
    swap_space: int = _f(256 << 20, "bytes of host memory for swapped-out KV blocks")
    kv_offload_gib: float = _f(0.0, "GiB of host memory for a second prefix-cache tier: blocks the device "
                                    "evicts move there (least recently used go first) and a later hit loads them "
                                    "back instead of recomputing; one host pool with swap_space (0: off)")
    async_scheduling: bool = _f(
        True, "schedule and dispatch step N+1 while the device runs step N (sampled tokens feed the next step on "
              "the device); --no-async-scheduling waits for each step's tokens before scheduling the next")
    python_gc_threshold: int | None = _f(
        20_000, "Python's garbage collector runs its youngest generation after this many more tracked objects "
                "were allocated than freed (Python's default: 700), set for the whole process when an engine "
                "is built (only ever raised): a step at 256 running requests makes a few thousand short-lived "
                "objects, and at 700 the collector ran several times a step; 700 (or None) keeps Python's pace")
    logprobs_mode: str = _f(
        "raw", "what sampled tokens' logprobs describe: raw (the model's distribution, before any adjustment) or "
               "processed (the distribution each token was drawn from: after penalties, logit_bias, min_tokens bans "
               "and grammar masks, divided by the temperature, cut by top-k/top-p/min-p and renormalized; greedy "
               "rows: the adjusted logits at temperature 1, untruncated); RL rollouts want processed. Prompt "
               "logprobs are always raw", choices=("raw", "processed"))
    batch_invariant: bool = _f(
        False, "a request's logits, logprobs and sampled tokens bit-identical whatever else its steps hold (the "
               "bucket, the neighbours, prefill chunks, prefix-cache hits, preemption) and equal to "
               "jaxserve.reference_logprobs(..., batch_invariant=True): row-tiled matmuls and norms and a "
               "fixed-order attention (docs/rl.md); float weights and KV, one device, no speculation; costs "
               "throughput (docs/benchmarks.md)")
    speculative_config: SpeculativeConfig | None = _f(
        None, "speculative decoding, as JSON (a dict for LLM): {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}: guesses from the request's own tokens, verified "
              "in decode-only steps when the measured step times say they pay (default: off)",
        parse=SpeculativeConfig.parse)
    tensor_parallel_size: int = _f(
        1, "devices the model is split over (tensor parallelism: heads and MLP columns per device, one "
           "all-reduce after attention and one after the MLP per layer); must divide the query heads and the "
           "intermediate size, and divide or be a multiple of the KV heads (the error names the sizes that work)")
    expert_parallel_size: int = _f(
        1, "mixture-of-experts models: device groups the experts are split over (expert parallelism; each group "
           "of tensor_parallel_size devices holds num_experts / this many experts and computes attention as "
           "tensor parallelism does, so the engine takes expert_parallel_size x tensor_parallel_size devices); "
           "must divide the number of experts (the error names the sizes that work)")
    expert_dispatch: str = _f(
        "auto", "expert parallelism's token dispatch: all_gather (every device runs its experts over the "
                "replicated tokens routed to them, one all-reduce combines), all_to_all (tokens sent to their "
                "experts' devices and back), or auto (the one measured cheaper per step size: all_gather; "
                "docs/benchmarks.md, Mixture of experts)", choices=("auto", "all_gather", "all_to_all"))
    num_hosts: int = _f(
        1, "processes (hosts) the mesh spans, joined by jax.distributed (or JAX_NUM_PROCESSES); rank 0 schedules and "
           "serves, the others run its steps; tensor_parallel_size must then count every host's devices")
    host_rank: int | None = _f(None, "this process's rank among num_hosts (or JAX_PROCESS_ID); 0 serves")
    coordinator_address: str | None = _f(
        None, "HOST:PORT of rank 0's coordination service, the same on every host (or JAX_COORDINATOR_ADDRESS)")
    host_timeout_s: float = _f(30.0, "a host silent this long ends every other host with an error naming it")
    attention_impl: str = _f("auto", "attention implementation: auto, xla, reference, mosaic, triton, *_interpret")
    xla_optimization_level: int | None = _f(
        None, "XLA backend optimization level (tests use 0: half the compile time, slower steps)")
    compilation_cache_dir: str | None = _f(
        os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla"),
        "persistent XLA compilation cache ('' disables it)")
    cache_dir: str | None = _f(
        os.path.join(os.path.expanduser("~"), ".cache", "jaxserve"),
        "what start-up keeps for the next start: checkpoint identities, prepared GGUF weights, serialized "
        "executables, calibration timings ('' disables it)")
    enable_prompt_logprobs: bool = _f(
        False, "serve SamplingParams.prompt_logprobs (and /v1/completions echo with logprobs, lm-eval's "
               "loglikelihood): the steps also return their hidden states and one more small function per step "
               "row count is compiled at start-up (the LM head, log_softmax, top-k); off, a request asking for "
               "them is refused at the door and nothing more is compiled")
    enable_embeddings: bool = _f(
        False, "serve embeddings (LLM.embed, /v1/embeddings, the Embed RPC): the steps also return their hidden "
               "states (as for prompt logprobs) and one more small function per step row count is compiled at "
               "start-up (the pooled sums); off, an embedding request is refused and nothing more is compiled")
    enable_lora: bool = _f(
        False, "serve LoRA adapters (PEFT directories) per request beside the base model: max_loras device slots "
               "of rank max_lora_rank beside every projection, one batch mixing adapters freely; adapters register "
               "by LLM/Engine.add_lora or a request's LoRARequest; speculation only by ngram, one device, no "
               "batch_invariant (docs/design.md, LoRA adapters)")
    max_loras: int = _f(1, "enable_lora: adapters resident on the device at once (device slots); more registered "
                           "adapters wait on the host and take a slot when a request needs one (least recently "
                           "used idle slot evicted)")
    max_lora_rank: int = _f(16, "enable_lora: the largest adapter rank served (every slot has this rank; "
                                "smaller ranks are padded with zeros, larger ones refused)")
    chat_template: str | None = _f(
        None, "a Jinja chat template (a file, or the template text) used instead of the model's own: e.g. one "
              "that renders tools for a model whose template does not")
    warm_up: str = _f(
        "all", "first runs before requests: all (every step is loaded and run once before the engine takes a "
               "request, so none pays a step's slow first run), background (the engine is ready once the steps "
               "of one request in 8-token chunks are warm, and warms the rest in a thread; steps are capped to "
               "warm ones meanwhile: `jaxserve serve`'s default) or none (steps load at first use; for callers "
               "that warm what their first requests need, as `jaxserve generate` does)",
        choices=("all", "background", "none"))
    role: str = _f("both", "disaggregated serving: prefill (compute prompts, hold their KV for decode engines under a "
                           "lease), decode (load prompts' KV from prefill engines, stream the rest), or both (a "
                           "colocated engine)", choices=("both", "prefill", "decode"))
    kv_lease_s: float = _f(30.0, "prefill role: seconds a finished prompt's KV blocks are held for a decode engine "
                                 "after its last heartbeat, then freed")
    kv_load_timeout_s: float = _f(10.0, "decode role: seconds a KV load may take, on this engine's clock; then it is "
                                        "cancelled and --kv-load-failure-policy applies")
    kv_load_failure_policy: str = _f(
        "recompute", "decode role: a KV load that failed or timed out is recomputed here (recompute) or ends the "
                     "request with UNAVAILABLE (fail)", choices=("recompute", "fail"))

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.chat_template:   # checked before anything loads: a bad one fails the start in a moment
            from jaxserve.engine.chat_template import load_chat_template

            load_chat_template(self.chat_template)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} must be one of auto, float32, bfloat16")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization={self.quantization!r} must be one of {', '.join(QUANTIZATION_MODES)}")
        if self.quantization_group_size not in (32, 128):
            raise ValueError(f"quantization_group_size={self.quantization_group_size!r} must be 32 or 128")
        if self.quantize_lm_head and self.quantization != "w8a8":
            raise ValueError(f"quantize_lm_head=True needs quantization='w8a8' (got {self.quantization!r})")
        if self.quantize_lm_head and self.tensor_parallel_size > 1:
            raise ValueError("quantize_lm_head=True is not supported with tensor_parallel_size > 1 (the int8 "
                             "head is not split over the mesh)")
        if self.kv_cache_dtype not in ("auto", "fp8_e4m3", "int8"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be one of auto, fp8_e4m3, int8")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "prefill_tile", "starvation_steps",
                     "tensor_parallel_size", "expert_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "usable_kv_blocks", "python_gc_threshold"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name}={v!r} must be a positive integer or None")
        if not isinstance(self.num_hosts, int) or self.num_hosts < 1:
            raise ValueError(f"num_hosts={self.num_hosts!r} must be a positive integer")
        if not (isinstance(self.host_timeout_s, (int, float)) and math.isfinite(self.host_timeout_s)
                and self.host_timeout_s > 0):
            raise ValueError(f"host_timeout_s={self.host_timeout_s!r} must be a finite number > 0")
        for name in ("max_num_partial_prefills", "max_waiting_requests", "swap_space"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0")
        if not (isinstance(self.kv_offload_gib, (int, float)) and not isinstance(self.kv_offload_gib, bool)
                and math.isfinite(self.kv_offload_gib) and self.kv_offload_gib >= 0):
            raise ValueError(f"kv_offload_gib={self.kv_offload_gib!r} must be a finite number >= 0")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gib is a tier of the prefix cache: it needs enable_prefix_caching")
        if self.kv_offload_gib and self.num_hosts > 1:
            raise ValueError("kv_offload_gib is not supported with num_hosts > 1 (the host pool's copies run "
                             "outside the steps the other hosts mirror)")
        if self.batch_invariant:
            self._check_batch_invariant()
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.enable_lora:
            self._check_lora()
        if not 0 <= self.kv_watermark < 1:
            raise ValueError(f"kv_watermark={self.kv_watermark} must be in [0, 1)")
        if self.priority_weight_base < 1:
            raise ValueError(f"priority_weight_base={self.priority_weight_base} must be >= 1")
        for name in ("kv_lease_s", "kv_load_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        for name, allowed in (("role", ("both", "prefill", "decode")),
                              ("kv_load_failure_policy", ("recompute", "fail")),
                              ("scheduling_policy", ("fcfs", "priority")),
                              ("preemption_mode", ("auto", "recompute", "swap")),
                              ("warm_up", ("all", "background", "none")),
                              ("logprobs_mode", ("raw", "processed")),
                              ("expert_dispatch", ("auto", "all_gather", "all_to_all"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.long_prefill_token_threshold is not None and (
                not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0):
            raise ValueError(f"long_prefill_token_threshold={self.long_prefill_token_threshold!r} must be an "
                             f"integer >= 0 or None")
        for name in ("itl_budget_ms", "ttft_slo_ms", "tpot_slo_ms"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite number > 0 or None")
        if self.chunk_policy not in ("slo", "itl"):
            raise ValueError(f"chunk_policy={self.chunk_policy!r} must be one of ('slo', 'itl')")
        if (self.usable_kv_blocks is not None and self.num_kv_blocks is not None
                and self.usable_kv_blocks > self.num_kv_blocks):
            raise ValueError(f"usable_kv_blocks={self.usable_kv_blocks} exceeds num_kv_blocks={self.num_kv_blocks}")
        for name in ("decode_buckets", "decode_only_buckets", "prefill_buckets"):
            v = getattr(self, name)
            if v is not None:
                v = tuple(int(x) for x in v)
                if list(v) != sorted(set(v)) or (v and v[0] < 0):
                    raise ValueError(f"{name}={v} must be increasing non-negative integers")
                object.__setattr__(self, name, v)

    def _check_batch_invariant(self) -> None:
        # what the mode's kernels do not cover is refused, never silently left variant
        refused = {
            "quantization": self.quantization not in ("none", None),
            "kv_cache_dtype": self.kv_cache_dtype != "auto",
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "expert_parallel_size": self.expert_parallel_size > 1,
            "num_hosts": self.num_hosts > 1,
            "speculative_config": self.speculative_config is not None,
        }
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise ValueError(f"batch_invariant=True computes float weights and KV on one device without "
                             f"speculation; unset {', '.join(bad)}")

    def _check_lora(self) -> None:
        # what LoRA slots are not built for is refused here, before anything loads
        spec = self.speculative_config
        refused = {
            "speculative_config with a draft model (ngram speculation works: the adapted model verifies "
            "its guesses; a draft model would guess without the adapter)": spec is not None and spec.method != "ngram",
            "batch_invariant (the LoRA delta is not row-tiled)": self.batch_invariant,
            "expert_parallel_size > 1": self.expert_parallel_size > 1,
            "num_hosts > 1 (slot writes run outside the steps other hosts mirror)": self.num_hosts > 1,
        }
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise ValueError("enable_lora=True is not supported with " + "; ".join(bad))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)
