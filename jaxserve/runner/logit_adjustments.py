"""What a request asks the sampler to do to its logits before choosing: presence, frequency and
repetition penalties and a logit bias (vLLM's and OpenAI's definitions), carried to the runner on
the request's SamplingOptions.

The penalties read the request's tokens: the prompt and the outputs so far. The host knows all of
them but the one a step in flight is sampling (the one-step-ahead loop); that one is on the
device, where the sampler reads it from the previous step's sampled ids, as the step reads its
placeholders. The known ones reach the runner as data: options that read them say so
(`reads_tokens`), and the scheduler then sends each step of such a request the outputs the host
learned since its last one (sched/scheduler_output.py's TokenHistory), which the persistent batch
keeps per seat (runner/persistent_batch.py); the sampler adds the in-flight one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.runner.token_mask import TokenConstraint
from jaxserve.sched.sampling import SamplingOptions


@dataclass(frozen=True, slots=True)
class LogitAdjustments:
    presence_penalty: float = 0.0       # subtracted once from every token already in the output
    frequency_penalty: float = 0.0      # subtracted per occurrence in the output
    repetition_penalty: float = 1.0     # divides positive (multiplies negative) logits of tokens in prompt or output
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)

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
    def reads_tokens(self) -> bool:   # SamplingOptions.reads_tokens: the penalties count them
        return self.adjust is not None and self.adjust.needs_tokens

    @property
    def allows_drafts(self) -> bool:
        # penalties count the tokens before each row and a grammar's mask follows its state, both
        # of which a guess would change: such requests decode one token per step
        return False
