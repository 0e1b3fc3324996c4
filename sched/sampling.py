"""SamplingOptions: what the runner needs to choose one request's tokens, typed.

The scheduler never reads these fields; it carries them from the request to the step it schedules
(`ScheduledRequest.sampling`), so the runner's sampler gets a typed record instead of an opaque
payload. The engine builds one per request from the user's SamplingParams at the door.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# Most ids one request can have masked before min_tokens (EOS and its stop ids): the sampler's
# fixed width. The engine's door refuses a request that would need more, so none is ever dropped.
MAX_BANNED_IDS = 64


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    temperature: float = 0.0               # 0 = greedy
    top_k: int = 0                         # 0 = no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0                          # the request's seed, or one the engine drew for it
    min_tokens: int = 0
    # ids masked while fewer than min_tokens outputs exist (EOS unless ignored, and stop ids)
    banned_before_min_tokens: tuple[int, ...] = ()
    num_logprobs: int | None = None        # top logprobs per sampled token; None = no logprobs
    # prompt logprobs (runner/prompt_logprobs.py): top alternatives per prompt token (None: none
    # asked), and the prompt's ids, which a prompt row's target (the next prompt token) comes from
    # when a chunk ends before it
    num_prompt_logprobs: int | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # embeddings (runner/pooling.py): "last" or "mean", the hidden states the runner sums for this
    # request's rows; None: a generation request
    pooling: str | None = None

    # Whether the sampler reads the request's tokens, its prompt and outputs (the penalties,
    # runner/logit_adjustments.py): the scheduler then sends the runner the outputs the host
    # learned since the request's last step (ScheduledRequest.token_history). A class attribute,
    # not a property: the scheduler reads it per request per step; a subclass overrides it.
    reads_tokens: ClassVar[bool] = False

    @property
    def wants_logprobs(self) -> bool:
        return self.num_logprobs is not None

    @property
    def allows_drafts(self) -> bool:
        """Whether speculative guesses may be verified for this request (sched/speculation.py):
        a row's options must not depend on the tokens before it beyond the step index."""
        return True


GREEDY = SamplingOptions()
