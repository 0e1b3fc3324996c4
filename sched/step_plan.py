"""A step as one schedule() call builds it: its budget, the requests it carries, and the block
operations and preemptions decided on the way.

The scheduler decides who runs and how many tokens (scheduler.py); `StepPlan` records each
decision as the runner will read it (a ScheduledRequest) and advances the request's state as if
the step had run: `num_computed_tokens` moves past the chunk, and a sampling step counts a pending
output. `take_back` undoes that for a request preempted later in the same call. The scheduler turns
the finished plan into its SchedulerOutput.

A request whose sampler reads its tokens (penalties) gets its `TokenHistory` here too: the outputs
since the step that last sent them when that was the step before this one (the runner's seat, and
its copy of the tokens, lasted), else the prompt and every output. Only such requests pay for it.
"""

from __future__ import annotations

from jaxserve.sched.lora_slots import LoRASlots
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest, TokenHistory
from jaxserve.sched.step_cost import StepCostModel


def padded_tokens(n: int, granularity: int) -> int:
    """Budget a chunk of n tokens costs: the runner computes a multi-token chunk in tiles of
    `granularity` rows, so its padded size is what the step really pays for."""
    return n if n <= 1 else -(-n // granularity) * granularity


class StepPlan:
    """What one schedule() call has decided so far."""

    __slots__ = ("budget", "scheduled", "copies", "preempted", "swap_out", "swap_in", "partial", "host_freed",
                 "admitted", "decodes", "decode_reqs", "allowance_s", "decode_s", "prefill_tiles", "prefill_items",
                 "step", "_granularity", "_step_cost", "_lora_slots")

    def __init__(self, budget: int, granularity: int, step_cost: StepCostModel | None = None,
                 lora_slots: LoRASlots | None = None, step: int = 0) -> None:
        self.budget = budget
        self.step = step  # the scheduler's step number (its schedule() calls, counted)
        self.scheduled: dict[str, ScheduledRequest] = {}
        self.copies: list[tuple[int, int]] = []
        self.preempted: list[str] = []
        # (device block, host-pool id) and (host-pool id, device block), in the order decided:
        # swap preemption's and the host tier's (kv_cache_manager.begin_step)
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.partial: set[str] = set()  # requests left mid-prefill after this step
        # host blocks read by this step's swap-ins: freed only after the step's decisions, so a
        # swap-out of the same step (which the runner performs first) cannot overwrite them
        self.host_freed: list[int] = []
        self.admitted: set[str] = set()  # taken from the waiting queue in this step
        self.decodes = 0  # requests that already stream outputs, scheduled one token each
        self.decode_reqs: list[Request] = []
        # the time budget of a step with decodes (config.objectives; step_budget.py), set when the
        # first prompt chunk is sized, and what the step holds so far in the step-cost model's terms
        self.allowance_s: float | None = None
        self.decode_s = 0.0
        self.prefill_tiles = 0
        self.prefill_items = 0
        self._granularity = granularity
        self._step_cost = step_cost
        self._lora_slots = lora_slots

    def charge(self, n: int) -> int:
        return padded_tokens(n, self._granularity)

    def _lora_slot(self, req: Request) -> int:
        return self._lora_slots.slot_of(req) if self._lora_slots is not None else 0

    def add(self, req: Request, n: int, draft: list[int] | None = None) -> None:
        """Put n of req's tokens in this step (its last known token and `draft`, the guesses after
        it, if any) and advance its state as if the step had run. A verification's guesses are
        taken back at update() as far as they were rejected."""
        if n == 1 and not draft:
            self.add_decode(req)
            return
        # the counts read once (this runs per running request per step)
        c0 = req.num_computed_tokens
        num_prompt = len(req.prompt_token_ids)
        num_outputs = len(req.output_token_ids) + req.num_pending_output_tokens   # pending included
        known = num_prompt + len(req.output_token_ids)
        with_pending = num_prompt + num_outputs
        end = c0 + n
        if draft:
            token_ids = req.token_slice(c0, known) + tuple(draft)
            sample = True
        else:
            token_ids = req.token_slice(c0, min(end, known)) + (PLACEHOLDER_TOKEN,) * max(0, end - max(c0, known))
            sample = end == with_pending
        self.scheduled[req.request_id] = ScheduledRequest(
            req.request_id, token_ids, c0, req.block_table, sample, num_outputs, req.sampling,
            len(draft) if draft else 0, self._lora_slot(req),
            self.token_history(req) if req.sampling.reads_tokens else None)
        self.budget -= n if draft else self.charge(n)
        if draft:
            self.decodes += 1
            self.decode_reqs.append(req)
        elif self._step_cost is not None:
            tiles, items = self._step_cost.chunk_items(c0, n)
            self.prefill_tiles += tiles
            self.prefill_items += items
        if end < with_pending and not draft:
            self.partial.add(req.request_id)
        req.num_computed_tokens = end
        if sample:
            req.num_pending_output_tokens += 1

    def add_decode(self, req: Request) -> None:
        """add() for one token without guesses (every running request, every step): its last
        known token, or a placeholder for the one the step in flight samples; a prompt's one-token
        chunk takes this path too."""
        c0 = req.num_computed_tokens
        prompt, outputs = req.prompt_token_ids, req.output_token_ids
        num_prompt = len(prompt)
        known = num_prompt + len(outputs)
        pending = req.num_pending_output_tokens
        num_outputs = len(outputs) + pending
        if c0 >= known:
            token = PLACEHOLDER_TOKEN
        else:
            token = prompt[c0] if c0 < num_prompt else outputs[c0 - num_prompt]
        end = c0 + 1
        sample = end == known + pending
        lora = self._lora_slots
        s = req.sampling
        self.scheduled[req.request_id] = ScheduledRequest(
            req.request_id, (token,), c0, req.block_table, sample, num_outputs, s, 0,
            lora.slot_of(req) if lora is not None else 0, self.token_history(req) if s.reads_tokens else None)
        self.budget -= 1
        if num_outputs > 0:
            self.decodes += 1
            self.decode_reqs.append(req)
        elif self._step_cost is not None:
            tiles, items = self._step_cost.chunk_items(c0, 1)
            self.prefill_tiles += tiles
            self.prefill_items += items
        if not sample:
            self.partial.add(req.request_id)
        req.num_computed_tokens = end
        if sample:
            req.num_pending_output_tokens = pending + 1

    def token_history(self, req: Request) -> TokenHistory:
        """What the runner adds to its copy of req's tokens this step (scheduler_output.TokenHistory).
        The runner keeps the copy while every step carries the request, so only a request sent one
        in the step before gets a delta; any other gets everything again (first step, preempted,
        sat a step out). The outputs are those the host knows: the one in flight, if any, is read
        on the device."""
        outputs = req.output_token_ids
        n = len(outputs)
        if req.history_step == self.step - 1:
            sent = req.num_outputs_sent
            history = TokenHistory(sent, tuple(outputs[sent:]) if n > sent else ())
        else:
            history = TokenHistory(0, tuple(outputs), tuple(req.prompt_token_ids))
        req.history_step = self.step
        req.num_outputs_sent = n
        return history

    def take_back(self, req: Request) -> bool:
        """Undo what add() advanced for a request preempted after it was added (nothing if it was
        not); True if a block copy of this step was writing into one of its blocks (dropped with
        it: such a request cannot be swapped, its block has no content yet)."""
        sr = self.scheduled.pop(req.request_id, None)
        if sr is None:
            return False
        self.budget += len(sr.token_ids) if sr.num_draft_tokens else self.charge(len(sr.token_ids))
        self.partial.discard(req.request_id)
        req.num_computed_tokens = sr.num_computed_tokens
        if sr.sample:
            req.num_pending_output_tokens -= 1
        if sr.token_history is not None:
            req.history_step = None   # the runner will not see this step's delta: all again next time
        mine = set(req.block_ids)
        kept = [(s, d) for s, d in self.copies if d not in mine]
        pending_copy = len(kept) != len(self.copies)
        self.copies[:] = kept
        return pending_copy
