"""What crosses the boundary between the scheduler and the rest of the engine, once per step.

`Scheduler.schedule()` returns a `SchedulerOutput`: for each request that runs this step, the
input tokens to compute and the block table to write their K/V into, plus the block operations the
runner performs before the step (copy-on-write copies, swaps). `Scheduler.update()` returns one
`RequestUpdate` per request it touched, which the engine turns into streamed outputs.

A token the previous step sampled but the host has not seen yet appears in `token_ids` as
`PLACEHOLDER_TOKEN`; the runner takes its value from that step's sampled tokens on the device.

A request whose sampler reads its tokens (penalties: `SamplingOptions.reads_tokens`) also carries
a `TokenHistory`: the outputs the host learned since its last step, from which the runner extends
its own copy of the request's tokens, or everything (prompt and outputs) when the runner holds no
copy. The runner never reads the scheduler's `Request`: what it needs crosses here, as data.
"""

from __future__ import annotations

from dataclasses import dataclass
from jaxserve.sched.kv_connector import KVConnectorOps
from jaxserve.sched.request import Request
from jaxserve.sched.sampling import GREEDY, SamplingOptions

PLACEHOLDER_TOKEN = -1  # "the token this request's previous step sampled", resolved on the device


@dataclass(slots=True)
class TokenHistory:
    """The tokens a request's penalties count (its prompt and outputs), as the deltas the runner's
    copy of them grows by. The runner keeps a copy per seat, and a seat lasts while every step
    carries its request (persistent_batch.py), so the scheduler sends the outputs learned since the
    request's last step, or the prompt and every output when that step was not the one before
    (the request's first step, or its first back after a step without it: preempted, not scheduled).
    The token a step in flight is sampling is in none of them: the runner's sampler reads it from
    that step's sampled ids on the device, as the step reads its placeholder.

    Made only for requests whose options read their tokens (sched/step_plan.py); plain data, so a
    step stays picklable and small: a decode's delta is its one or no new token. Not frozen, as
    ScheduledRequest below is not (made per such request per step); read it as frozen."""

    num_outputs_before: int                        # outputs the runner's copy already holds (0 with a prompt)
    new_output_token_ids: tuple[int, ...]          # outputs known to the host, after those
    prompt_token_ids: tuple[int, ...] | None = None   # not None: the copy starts afresh from this prompt

    @property
    def restarts(self) -> bool:
        return self.prompt_token_ids is not None


# ScheduledRequest and RequestUpdate are made once per running request per step, so they are not
# frozen: a frozen dataclass's __init__ sets each field through object.__setattr__, about four
# times the cost of a plain one (~1 us for ScheduledRequest, of a host step's ~5-10 us per
# request). Nothing writes them after they are made; read them as frozen.
@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    # input tokens this step = all_token_ids[num_computed_tokens : num_computed_tokens + len(token_ids)]
    token_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens whose K/V are already cached (the context before this step)
    # the full block table after allocation for this step: the request's block_table, the same
    # tuple from step to step until its blocks change (the runner compares it by identity)
    block_ids: tuple[int, ...]
    sample: bool  # True iff this step reaches the last known token, so a new token is sampled
    num_output_tokens: int  # outputs sampled before this step, pending ones included (a seeded sampler's step index)
    sampling: SamplingOptions = GREEDY
    # speculative decoding: guessed next tokens, the tail of token_ids. The step computes every
    # token as a decode row and samples at each; update() keeps the guesses that each equal the
    # token sampled the row before, and the token sampled after the last one kept.
    num_draft_tokens: int = 0
    # the LoRA slot its rows compute under (lora_slots.py); 0: the base model
    lora_slot: int = 0
    # the tokens its penalties count, as a delta of the runner's copy (TokenHistory); None for a
    # request whose options do not read them (nearly all), so the others pay nothing for it
    token_history: TokenHistory | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.request_id!r} scheduled with 0 tokens")
        if self.num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {self.num_computed_tokens}")
        if self.num_draft_tokens and (not self.sample or self.num_draft_tokens >= len(self.token_ids)
                                      or PLACEHOLDER_TOKEN in self.token_ids):
            raise ValueError(f"request {self.request_id!r}: {self.num_draft_tokens} draft tokens need a sampling "
                             f"step with known tokens and one token before them, got {self.token_ids!r}")

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else ()

    @property
    def decode_rows(self) -> int:
        """Decode rows this request takes in the step: one per token of a decode or a verification
        (the runner computes drafts as decode rows), none for a prompt chunk (prefill tiles)."""
        if self.num_draft_tokens:
            return len(self.token_ids)
        return 1 if len(self.token_ids) == 1 else 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_placeholders(self) -> int:
        """Trailing tokens whose values the previous step sampled on the device."""
        n = 0
        for t in reversed(self.token_ids):
            if t != PLACEHOLDER_TOKEN:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    # (src, dst): copy block src into block dst before the step (copy-on-write of a shared block)
    block_copies: tuple[tuple[int, int], ...] = ()
    preempted_ids: tuple[str, ...] = ()  # requests evicted this step (they resume later)
    # (device block, host block): copy out of the arena before the step (preemption by swap).
    # Host blocks are numbered 0 .. num_host_blocks - 1 (the host pool has no null block).
    swap_out: tuple[tuple[int, int], ...] = ()
    # (host block, device block): copy into the arena before the step (a swapped request resumes)
    swap_in: tuple[tuple[int, int], ...] = ()
    # the step-cost model's time for a step with decodes and prompt tiles, before the scheduler's
    # learned scale (None: no model, or another kind of step); the engine reports the measured time
    # back (Scheduler.observe_step_time)
    predicted_s: float | None = None
    # the KV connector's runner-side work (kv_connector.py): loads to write, held blocks to gather,
    # after the swaps and before the copies
    kv_connector_ops: KVConnectorOps | None = None
    # (slot, adapter key): LoRA adapters to write into device slots before the step (lora_slots.py)
    lora_loads: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        total = sum(len(r.token_ids) for r in self.requests)
        if total != self.num_batched_tokens:
            raise ValueError(f"num_batched_tokens={self.num_batched_tokens} but the requests hold {total}")

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class RequestUpdate:
    request: Request  # the live request (its state after this update)
    new_token_ids: tuple[int, ...]  # tokens appended by this update (empty for a prefill chunk)
    finished: bool
