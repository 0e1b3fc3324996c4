"""What is compiled and when: the attention implementation, the shape buckets of the steps, the
first runs before requests (warm-up), and what start-up keeps for the next start."""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxserve.config.options import check_choice, check_positive_int, choices, option


@dataclass(frozen=True, slots=True)
class CompilationConfig:
    attention_impl: str = option("auto", "attention implementation: auto, xla, reference, mosaic, triton, "
                                         "*_interpret")
    xla_optimization_level: int | None = option(
        None, "XLA backend optimization level (tests use 0: half the compile time, slower steps)")
    compilation_cache_dir: str | None = option(
        os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla"),
        "persistent XLA compilation cache ('' disables it)")
    cache_dir: str | None = option(
        os.path.join(os.path.expanduser("~"), ".cache", "jaxserve"),
        "what start-up keeps for the next start: checkpoint identities, prepared GGUF weights, serialized "
        "executables, calibration timings ('' disables it)")
    prefill_tile: int = option(8, "query rows per prefill attention tile: the smallest prefill chunk a step carries "
                                  "beside decodes (LLM defaults to 16: bulk prefill runs faster in bigger tiles)")
    decode_buckets: tuple[int, ...] | None = option(
        None, "compiled decode rows of steps with prefill tiles (default: 1, 4, 16, ... max_num_seqs)")
    decode_only_buckets: tuple[int, ...] | None = option(
        None, "compiled decode rows of decode-only steps (default: decode_buckets if those are set, else "
              "1, 2, 4, 6, 8, 12, 16, 24, 32, 48, ... max_num_seqs)")
    prefill_buckets: tuple[int, ...] | None = option(None, "compiled prefill tile counts (default: 0, 1, 2, 4, ... "
                                                           "max)")
    fuse_sampler: bool | None = option(
        None, "each compiled step samples its logits rows itself: one launch per step instead of a step and a "
              "sampler (a draft model's speculation keeps them apart). Default: fused on an accelerator, where "
              "the host's launches set the pace; apart on a CPU, where fusing saves ~0.2 ms a step and costs "
              "1.6x or more the compile time of every bucket (a sampler in each: docs/benchmarks.md)")
    warm_up: str = option(
        "all", "first runs before requests: all (every step is loaded and run once before the engine takes a "
               "request, so none pays a step's slow first run), background (the engine is ready once the steps "
               "of every seat with a prompt tile beside them are warm, and warms the rest in a thread, those that "
               "only save padding while idle; steps run padded in warm ones meanwhile: `jaxserve serve`'s "
               "default), serving (ready once every step a full server needs is warm, the padding-only ones "
               "warmed while idle: full speed at ready, later ready) or none (steps load at first use; for "
               "callers that warm what their first requests need, as `jaxserve generate` does)",
        choices=("all", "background", "serving", "none"))

    def __post_init__(self) -> None:
        check_positive_int(self, "prefill_tile")
        check_choice(self, "warm_up", choices(self, "warm_up"))
        for name in ("decode_buckets", "decode_only_buckets", "prefill_buckets"):
            v = getattr(self, name)
            if v is not None:
                v = tuple(int(x) for x in v)
                if list(v) != sorted(set(v)) or (v and v[0] < 0):
                    raise ValueError(f"{name}={v} must be increasing non-negative integers")
                object.__setattr__(self, name, v)
