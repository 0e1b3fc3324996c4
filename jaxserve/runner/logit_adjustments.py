"""What a request asks the sampler to do to its logits before choosing: presence, frequency and
repetition penalties and a logit bias (vLLM's and OpenAI's definitions), carried to the runner on
the request's SamplingOptions.

The penalties read the request's tokens: the prompt and the outputs so far. The host knows all of
them but the one a step in flight is sampling (the one-step-ahead loop); that one is on the
device, where the sampler reads it from the previous step's sampled ids, as the step reads its
placeholders. So the runner packs the known tokens from the scheduler's Request (`KnownTokens`)
and the sampler adds the in-flight one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.runner.token_mask import TokenConstraint
from jaxserve.sched.sampling import SamplingOptions


class KnownTokens:
    """The request's prompt and the outputs the host knows, read when a step is packed. The engine
    binds it to the scheduler's Request once that exists (the Request holds its options)."""

    __slots__ = ("request",)

    def __init__(self) -> None:
        self.request = None

    def prompt_and_outputs(self) -> tuple[list[int], list[int]]:
        r = self.request
        return r.prompt_token_ids, r.output_token_ids


@dataclass(frozen=True, slots=True)
class LogitAdjustments:
    presence_penalty: float = 0.0       # subtracted once from every token already in the output
    frequency_penalty: float = 0.0      # subtracted per occurrence in the output
    repetition_penalty: float = 1.0     # divides positive (multiplies negative) logits of tokens in prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    tokens: KnownTokens = field(default_factory=KnownTokens, compare=False)

    @property
    def needs_tokens(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True, slots=True)
class AdjustedSamplingOptions(SamplingOptions):
    """SamplingOptions with logit adjustments and/or a token mask (structured output,
    runner/token_mask.py); the scheduler carries it as any SamplingOptions."""

    adjust: LogitAdjustments | None = None
    constraint: TokenConstraint | None = field(default=None, compare=False)

    @property
    def allows_drafts(self) -> bool:
        # penalties count the tokens before each row and a grammar's mask follows its state, both
        # of which a guess would change: such requests decode one token per step
        return False
