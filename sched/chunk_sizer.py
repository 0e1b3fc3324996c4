"""How many of a request's tokens a step computes: the token budget, the chunk caps, and (with
objectives) the step's time allowance; and what the step is predicted to take.

A decode's one token is never asked for here (the scheduler gives it whenever budget is left);
a prompt's chunk is sized after every decode of the step is placed, so `st.decodes` is final.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxserve.sched.request import Request
from jaxserve.sched.request_queue import WaitingQueue
from jaxserve.sched.scheduler_config import SchedulerConfig
from jaxserve.sched.step_budget import StepTimeScale, chunk_within, step_allowance
from jaxserve.sched.step_plan import StepPlan


class ChunkSizer:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float], running: list[Request],
                 waiting: WaitingQueue) -> None:
        self.config = config          # replaced by Scheduler.retune
        self._clock = clock
        self._running, self._waiting = running, waiting   # the scheduler's own, read in place
        self.step_time = StepTimeScale()  # measured / predicted step time, learned (observe)

    def num_new_tokens(self, req: Request, num_computed: int, st: StepPlan) -> int:
        """Tokens to compute for req this step (0 = it cannot run now)."""
        c = self.config
        budget = st.budget
        n = req.num_tokens_with_pending - num_computed
        if not c.enable_chunked_prefill:
            return n if st.charge(n) <= budget else 0
        if c.long_prefill_token_threshold:
            n = min(n, c.long_prefill_token_threshold)
        cap = c.prefill_cap_beside(st.decodes) if st.decodes and n > 1 else 0
        if cap:
            n = min(n, cap)
        if c.objectives is not None and st.decodes and n > 1:
            n = self._within_allowance(num_computed, n, st)
        if st.charge(n) <= budget:
            return n
        fit = (budget // c.chunk_granularity) * c.chunk_granularity
        return fit if fit > 1 else min(1, budget, n)

    def _within_allowance(self, num_computed: int, n: int, st: StepPlan) -> int:
        """How many of n next prompt tokens fit this step's time allowance (step_budget.py)."""
        cost = self.config.step_cost
        if st.allowance_s is None:
            st.decode_s = cost.decode_seconds([r.num_computed_tokens for r in st.decode_reqs])
            # the model's seconds, as this machine runs them now
            scale = self.step_time.value
            st.allowance_s = step_allowance(cost, self.config.objectives, self._clock(), st.decode_reqs,
                                            st.decode_s, self._prompt_order(), st.budget, scale) / scale
        return chunk_within(cost, num_computed, n, st.decode_s, st.prefill_tiles, st.prefill_items, st.allowance_s)

    def _prompt_order(self) -> list[Request]:
        """Requests with prompt tokens left, in the order this step serves them: running ones,
        then the waiting queue's head."""
        running = [r for r in self._running if r.num_tokens - r.num_computed_tokens > 1]
        return running + [self._waiting[j] for j in range(min(len(self._waiting), 8))]

    def predicted_seconds(self, st: StepPlan) -> float | None:
        """The step's model time by the step-cost model, for a step with decodes and prompt
        tiles the model covers (None otherwise, and without a step-cost model)."""
        cost = self.config.step_cost
        if cost is None or not st.decode_reqs or not st.prefill_tiles or st.prefill_tiles > cost.max_tiles:
            return None
        decode_s = cost.decode_seconds([r.num_computed_tokens for r in st.decode_reqs])
        return decode_s + cost.prefill_seconds(st.prefill_tiles, st.prefill_items)
