"""StepCap: a temporary bound on a step's seats and tokens, below the configured ones.

An engine that turns ready before every compiled step has had its first run (warm_up="background",
jaxserve/runner/warm_plan.py) sets one on its scheduler: a step of at most `seats` running
requests and `tokens` batched tokens can only pick buckets that are ready, so no request meets a
step that still has to load or compile. The warm-up raises the cap as more buckets become ready
and removes it (None) when all are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCap:
    seats: int      # most running requests (max_num_seqs, lowered)
    tokens: int     # most tokens of one step (max_num_batched_tokens, lowered)

    def __post_init__(self) -> None:
        if self.seats < 1 or self.tokens < 1:
            raise ValueError(f"a step cap of {self.seats} seats and {self.tokens} tokens admits no step")
