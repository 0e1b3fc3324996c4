"""Decode step time of a built LLM, read from what a user sees: RequestOutput.metrics.token_times.

A batch of B requests with distinct random prompts (no prefix-cache hits), greedy, EOS ignored,
is sent at once. Once the last prompt has its first token, every request decodes in every step
until the first one finishes; the steps inside that window are decode-only steps of exactly B
rows, and the gaps between one request's token times there are their durations (every request
of a step gets its token at the same moment). `max_tokens` is sized so that at least `steps`
such steps remain after the prompts are in.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np


@dataclass(frozen=True, slots=True)
class DecodeTiming:
    batch: int                      # decode rows of every timed step
    step_s: tuple[float, ...]       # one duration per timed step
    cached_prompt_tokens: int = 0   # prompt tokens the prefix cache served (fresh prompts: 0)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def per_token_s(self) -> float:
        return self.median_s / self.batch

    def as_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "steps": len(self.step_s), "step_ms": [s * 1e3 for s in self.step_s],
                "median_step_ms": self.median_s * 1e3, "per_token_ms": self.per_token_s * 1e3,
                "cached_prompt_tokens": self.cached_prompt_tokens}


@dataclass(frozen=True, slots=True)
class PairedTiming:
    """One batch size timed on a configuration's engine and on the default engine, in turn."""
    own: DecodeTiming                   # every round's steps, pooled
    default: DecodeTiming
    ratios: tuple[float, ...]           # per round: own per-token time / the default's beside it

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @classmethod
    def alone(cls, timing: DecodeTiming) -> "PairedTiming":
        """The default configuration against itself."""
        return cls(timing, timing, (1.0,))


def pooled(timings: Sequence[DecodeTiming]) -> DecodeTiming:
    """Timings of one batch size as one: every step of each."""
    batches = {t.batch for t in timings}
    if len(batches) != 1:
        raise ValueError(f"cannot pool timings of different batch sizes {sorted(batches)}")
    return DecodeTiming(batches.pop(), tuple(s for t in timings for s in t.step_s),
                        sum(t.cached_prompt_tokens for t in timings))


def full_batch_step_times(token_times: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Durations of the steps in which every request decoded, from each request's token times."""
    if not token_times or any(not t for t in token_times):
        raise ValueError("every request needs at least one token time")
    starts = [t[0] for t in token_times]
    window = (max(starts), min(t[-1] for t in token_times))
    last_started = token_times[starts.index(window[0])]
    inside = [t for t in last_started if window[0] <= t <= window[1]]
    return tuple(b - a for a, b in zip(inside, inside[1:]))


def output_tokens_for(batch: int, input_len: int, steps: int, token_budget: int) -> int:
    """max_tokens that leaves `steps` full-batch decode steps: admitting B prompts takes at most
    ceil(B * input_len / (budget - B)) + 1 steps (decodes share the budget), and the first
    requests already decode in those."""
    prefill_steps = -(-batch * input_len // max(token_budget - batch, 1)) + 1
    return prefill_steps + steps + 1


def measure_decode(llm: Any, *, batch: int, input_len: int, steps: int, seed: int) -> DecodeTiming:
    from jaxserve import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.engine.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, input_len).tolist()} for _ in range(batch)]
    max_tokens = output_tokens_for(batch, input_len, steps, llm.config.scheduler.max_num_batched_tokens)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    timed = full_batch_step_times([o.metrics.token_times for o in outputs])
    if len(timed) < steps:
        raise RuntimeError(f"only {len(timed)} of {steps} steps decoded all {batch} requests together")
    return DecodeTiming(batch, timed, sum(o.num_cached_tokens or 0 for o in outputs))


def time_beside(llm: Any, default: Any, *, batch: int, default_batch: int, rounds: int, input_len: int,
                steps: int, seeds: Iterator[int]) -> PairedTiming:
    """`rounds` times in turn: the default engine at default_batch, then `llm` at batch. A ratio of
    two timings taken seconds apart is what a shared machine allows; the median round's is kept."""
    pairs = []
    for _ in range(rounds):
        beside = measure_decode(default, batch=default_batch, input_len=input_len, steps=steps, seed=next(seeds))
        own = measure_decode(llm, batch=batch, input_len=input_len, steps=steps, seed=next(seeds))
        pairs.append((own, beside))
    return PairedTiming(pooled([o for o, _ in pairs]), pooled([d for _, d in pairs]),
                        tuple(o.per_token_s / d.per_token_s for o, d in pairs))
