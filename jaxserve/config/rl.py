"""What RL rollouts ask of sampling: which distribution logprobs describe, and batch invariance
(docs/rl.md)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.options import check_choice, choices, option


@dataclass(frozen=True, slots=True)
class RLConfig:
    logprobs_mode: str = option(
        "raw", "what sampled tokens' logprobs describe: raw (the model's distribution, before any adjustment) or "
               "processed (the distribution each token was drawn from: after penalties, logit_bias, min_tokens bans "
               "and grammar masks, divided by the temperature, cut by top-k/top-p/min-p and renormalized; greedy "
               "rows: the adjusted logits at temperature 1, untruncated); RL rollouts want processed. Prompt "
               "logprobs are always raw", choices=("raw", "processed"))
    batch_invariant: bool = option(
        False, "a request's logits, logprobs and sampled tokens bit-identical whatever else its steps hold (the "
               "bucket, the neighbours, prefill chunks, prefix-cache hits, preemption) and equal to "
               "jaxserve.reference_logprobs(..., batch_invariant=True): row-tiled matmuls and norms and a "
               "fixed-order attention (docs/rl.md); float weights and KV, one device, no speculation; costs "
               "throughput (docs/benchmarks.md)")

    def __post_init__(self) -> None:
        check_choice(self, "logprobs_mode", choices(self, "logprobs_mode"))
