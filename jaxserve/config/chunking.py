"""How prompt chunks are sized beside decodes (engine/chunk_policy.py turns these into the
scheduler's caps and objectives at start-up, from measured step times)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config.options import check_choice, check_positive_number, choices, option


@dataclass(frozen=True, slots=True)
class ChunkingConfig:
    long_prefill_token_threshold: int | None = option(
        None, "most prompt tokens of one request per step (0: no cap; default: itl_budget_ms x the prefill "
              "tokens/s measured at start-up, applied only to steps that carry decodes; LLM defaults to 0)")
    ttft_slo_ms: float | None = option(
        None, "time-to-first-token objective the prefill policy serves (default: derived at start-up, max(1 s, "
              "2 x a full-budget prefill step))")
    tpot_slo_ms: float | None = option(
        None, "time-per-output-token objective: a step that carries decodes stays within 0.9 x it, unless a "
              "prompt's TTFT is at risk and every decoder has banked that time (default: derived at start-up, "
              "max(100 ms, 1.5 x a decode step of max_num_seqs))")
    chunk_policy: str = option(
        "slo", "how prompt chunks are sized when long_prefill_token_threshold is not set: slo (to the TTFT and "
               "TPOT objectives by a step-time model measured at start-up) or itl (the earlier policy: one fixed "
               "chunk per decode bucket from an ITL budget, one prompt mid-prefill at a time)",
        choices=("slo", "itl"))
    itl_budget_ms: float | None = option(
        None, "chunk_policy=itl: time a step may add for prefill chunks while decodes wait, from which the chunk "
              "size is derived (default: the measured decode-only step time of the decode batch beside the chunk, "
              "one per decode bucket, i.e. a long prompt at most doubles the inter-token latency)")

    def __post_init__(self) -> None:
        t = self.long_prefill_token_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"long_prefill_token_threshold={t!r} must be an integer >= 0 or None")
        check_positive_number(self, "itl_budget_ms", "ttft_slo_ms", "tpot_slo_ms", optional=True)
        check_choice(self, "chunk_policy", choices(self, "chunk_policy"))
