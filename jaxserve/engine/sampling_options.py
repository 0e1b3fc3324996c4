"""A request's SamplingParams as the runner's options for one of its samples."""

from __future__ import annotations

from jaxserve.runner.logit_adjustments import AdjustedSamplingOptions, LogitAdjustments
from jaxserve.runner.token_mask import TokenConstraint
from jaxserve.sampling_params import SamplingParams
from jaxserve.sched.sampling import SamplingOptions

GREEDY_BELOW = 1e-5  # a temperature this small samples as greedy (as vLLM's _SAMPLING_EPS)


def sampling_options(params: SamplingParams, seed: int, banned: tuple[int, ...],
                     constraint: TokenConstraint | None = None, *, prompt_token_ids=(),
                     pooling: str | None = None) -> SamplingOptions:
    """The runner's options for one sample of a request (one per sample: each has its own seed and
    its own grammar state; the tokens its penalties count reach the runner from the scheduler,
    ScheduledRequest.token_history)."""
    common = dict(
        # below GREEDY_BELOW, logits / temperature overflows float32: the argmax is meant
        temperature=0.0 if params.temperature < GREEDY_BELOW else params.temperature,
        top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
        seed=seed, min_tokens=params.min_tokens, banned_before_min_tokens=banned, num_logprobs=params.logprobs,
        num_prompt_logprobs=params.prompt_logprobs,
        prompt_token_ids=tuple(prompt_token_ids) if params.prompt_logprobs is not None else (),
        pooling=pooling)
    if not params.adjusts_logits and constraint is None:
        return SamplingOptions(**common)
    adjust = None
    if params.adjusts_logits:
        adjust = LogitAdjustments(
            presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias or ())
    return AdjustedSamplingOptions(**common, adjust=adjust, constraint=constraint)
