"""EngineConfig: the engine's knobs, one frozen section per concern, each validated by itself;
what crosses sections is checked here.

Callers spell the knobs flat (`LLM(max_num_seqs=8)`, `--max-num-seqs 8`): jaxserve/engine_args.py
maps each flat name to its section. A section's field names are unique across sections, so the
flat spelling is the field's own name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.config.cache import CacheConfig
from jaxserve.config.chunking import ChunkingConfig
from jaxserve.config.compilation import CompilationConfig
from jaxserve.config.disagg import DisaggConfig
from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.model import ServedModelConfig
from jaxserve.config.options import check_positive_int, option
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.rl import RLConfig
from jaxserve.sched.scheduler_config import SchedulerOptions
from jaxserve.sched.speculation import SpeculativeConfig


def _section(cls, *, per_engine: bool = False):
    # per_engine: a second engine on the same compiled runner may set it anew (LLM.sharing_runner)
    return field(default_factory=cls, metadata={"section": True, "per_engine": per_engine})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ServedModelConfig = _section(ServedModelConfig)
    cache: CacheConfig = _section(CacheConfig)
    scheduler: SchedulerOptions = _section(SchedulerOptions)
    chunking: ChunkingConfig = _section(ChunkingConfig, per_engine=True)
    parallel: ParallelConfig = _section(ParallelConfig)
    lora: LoRAConfig = _section(LoRAConfig)
    disagg: DisaggConfig = _section(DisaggConfig)
    rl: RLConfig = _section(RLConfig)
    compilation: CompilationConfig = _section(CompilationConfig)
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, as JSON (a dict for LLM): {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 4}: guesses from the request's own tokens, verified "
              "in decode-only steps when the measured step times say they pay (default: off)",
        parse=SpeculativeConfig.parse, per_engine=True)
    kv_events_config: KVEventsConfig | None = option(
        None, "publish the prefix cache's block stored / removed / cleared events for a cluster router (llm-d, "
              "Dynamo, `jaxserve router --policy kv_events`), as JSON with vLLM's keys: {\"enable_kv_cache_events\": "
              "true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\"} "
              "(ZeroMQ, msgpack; default: off)", parse=KVEventsConfig.parse)
    async_scheduling: bool = option(
        True, "schedule and dispatch step N+1 while the device runs step N (sampled tokens feed the next step on "
              "the device); --no-async-scheduling waits for each step's tokens before scheduling the next",
        per_engine=True)
    python_gc_threshold: int | None = option(
        20_000, "Python's garbage collector runs its youngest generation after this many more tracked objects "
                "were allocated than freed (Python's default: 700), set for the whole process when an engine "
                "is built (only ever raised): a step at 256 running requests makes a few thousand short-lived "
                "objects, and at 700 the collector ran several times a step; 700 (or None) keeps Python's pace")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.kv_events_config is not None and not self.cache.enable_prefix_caching:
            raise ValueError("kv_events_config reports the prefix cache's blocks: it needs enable_prefix_caching")
        check_positive_int(self, "python_gc_threshold", optional=True)
        if self.model.quantize_lm_head and self.parallel.tensor_parallel_size > 1:
            raise ValueError("quantize_lm_head=True is not supported with tensor_parallel_size > 1 (the "
                             "quantized head is not split over the mesh)")
        if self.cache.kv_offload_gib and self.parallel.num_hosts > 1:
            raise ValueError("kv_offload_gib is not supported with num_hosts > 1 (the host pool's copies run "
                             "outside the steps the other hosts mirror)")
        if self.rl.batch_invariant:
            self._check_batch_invariant()
        if self.lora.enable_lora:
            self._check_lora()

    def _check_batch_invariant(self) -> None:
        # what the mode's kernels do not cover is refused, never silently left variant
        refused = {
            "quantization": self.model.quantization not in ("none", None),
            "kv_cache_dtype": self.cache.kv_cache_dtype != "auto",
            "tensor_parallel_size": self.parallel.tensor_parallel_size > 1,
            "expert_parallel_size": self.parallel.expert_parallel_size > 1,
            "num_hosts": self.parallel.num_hosts > 1,
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
            "batch_invariant (the LoRA delta is not row-tiled)": self.rl.batch_invariant,
            "expert_parallel_size > 1": self.parallel.expert_parallel_size > 1,
            "num_hosts > 1 (slot writes run outside the steps other hosts mirror)": self.parallel.num_hosts > 1,
        }
        bad = [name for name, on in refused.items() if on]
        if bad:
            raise ValueError("enable_lora=True is not supported with " + "; ".join(bad))

    @property
    def uses_draft_model(self) -> bool:
        """Whether a draft model runs beside the target (speculative_config method draft_model)."""
        spec = self.speculative_config
        return spec is not None and spec.method == "draft_model"

    @property
    def adaptive_speculation(self) -> bool:
        """Whether speculation weighs its guesses against measured step times."""
        return self.speculative_config is not None and self.speculative_config.adaptive
