"""One generation request as the scheduler sees it: its tokens, limits and progress.

The engine builds a `Request` at the door (after validating the user's input) and hands it to the
scheduler, which mutates its state fields every step: how many tokens have K/V in the cache
(`num_computed_tokens`), which blocks hold them (`block_ids`), the tokens sampled so far, and how
it ended. `sampling` is carried, never read, here: the runner's sampler needs it, so `sched`
needs neither a tokenizer nor jax.

With the one-step-ahead loop a step is scheduled before the previous step's sampled tokens reach
the host: `num_computed_tokens` counts tokens whose K/V are computed *or being computed* by a step
already scheduled, and `num_pending_output_tokens` the tokens such steps have sampled whose values
the host does not know yet (they stay on the device and feed the next step as placeholders).
Everything the scheduler keeps per request lives here too, so finishing a request is one
deletion.
"""

from __future__ import annotations

import enum
import time
from dataclasses import KW_ONLY, dataclass, field

from jaxserve.sched.kv_events import AdapterNamespace
from jaxserve.sched.sampling import GREEDY, SamplingOptions


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never ran, or a fork child waiting for its parent's prefill
    RUNNING = "running"  # holds blocks and a seat
    PREEMPTED = "preempted"  # evicted by recompute: back in the waiting queue, no blocks
    SWAPPED = "swapped"  # evicted by swap: waiting, its blocks live in the host pool
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # holds blocks its KV is being loaded into (kv_connector.py)
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token, or a stop string (engine)
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def is_waiting(self) -> bool:
        return self in _WAITING


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
_WAITING = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED})

FINISH_REASONS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    _: KW_ONLY
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0  # lower = more urgent (as in vLLM)
    arrival_time: float = field(default_factory=time.perf_counter)  # on the scheduler's clock
    cache_salt: str | None = None  # prefix-cache namespace; None = the public one
    sampling: SamplingOptions = GREEDY  # for the runner's sampler; the scheduler only carries it
    # disaggregated prefill (kv_connector.py): where this request's prompt KV waits to be loaded
    # (a RemoteKV), and whether its blocks are kept for a receiver when it ends (the sending side)
    remote_kv: object | None = None
    kv_send: bool = False
    # never share cached prefix blocks at admission (every prompt position is computed): a request
    # that asks for prompt logprobs needs every prompt row's logits. Its blocks still enter the
    # cache for others.
    skip_reading_prefix_cache: bool = False
    # the LoRA adapter it runs under (None: the base model): its name, and the key of the weights
    # registered under it (a name registered again gets a new key: KV computed under the old
    # weights is never served to the new ones). lora_slots.py gives it a device slot.
    lora_name: str | None = None
    lora_key: str | None = None

    # ---- state, mutated by the scheduler ----
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # logical block i -> physical block_ids[i]; changed only through set_blocks, add_blocks and
    # replace_block, which keep block_table true
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id, or a stop string set by the engine
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    # sampled by scheduled steps, not yet known on the host (0 or 1 with the one-step-ahead loop)
    num_pending_output_tokens: int = 0
    first_token_time: float | None = None  # when update() received its first output (scheduler's clock)

    # ---- the scheduler's bookkeeping (only sched writes these) ----
    queue_key: tuple = ()  # order in the waiting queue, kept across preemptions
    arrival_step: int = 0  # the scheduler step it arrived in (starvation guard)
    fork_parent_id: str | None = None  # a waiting fork child's parent
    host_block_ids: list[int] = field(default_factory=list)  # a swapped-out request's host blocks
    # speculative decoding (speculation.py): guesses accepted and judged, decayed counts
    spec_accepted: float = 0.0
    spec_trials: float = 0.0
    # the KV load in flight (kv_connector.py): its generation and the tokens it brings
    kv_load_generation: int = 0
    kv_load_tokens: int = 0
    # a request whose sampler reads its tokens (step_plan.StepPlan.token_history): the step that
    # last sent the runner its TokenHistory (None: none the runner may still hold) and the outputs sent
    history_step: int | None = None
    num_outputs_sent: int = 0
    # block_table's tuple; None once the blocks changed (not an argument, not compared or copied)
    _table: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def prefix_namespace(self) -> object:
        """What the prefix cache keys this request's blocks under: its cache salt (a tenant), and
        its adapter, whose K/V differ from the base model's for the same tokens."""
        if self.lora_key is None:
            return self.cache_salt
        return AdapterNamespace(self.cache_salt, self.lora_name, self.lora_key)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a str, got {self.request_id!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int, got {self.priority!r}")
        self.eos_token_ids = frozenset(self.eos_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.output_token_ids = list(self.output_token_ids)

    # ---- the block table ----
    @property
    def block_table(self) -> tuple[int, ...]:
        """block_ids as a tuple, the same object from step to step until the blocks change: a
        step's entries carry it without a copy per step, and the runner sees by identity that a
        row of its table is unchanged (most steps add no block to most requests)."""
        t = self._table
        if t is None:
            t = self._table = tuple(self.block_ids)
        return t

    def set_blocks(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self._table = None

    def add_blocks(self, block_ids) -> None:
        self.block_ids.extend(block_ids)
        self._table = None

    def replace_block(self, i: int, block_id: int) -> None:
        self.block_ids[i] = block_id
        self._table = None

    # ---- derived ----
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens including those sampled on the device whose values are not known yet."""
        return self.num_tokens + self.num_pending_output_tokens

    @property
    def num_outputs_with_pending(self) -> int:
        return len(self.output_token_ids) + self.num_pending_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """all_token_ids[start:end] without concatenating the whole sequence (decodes read 1)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return tuple(self.prompt_token_ids[start:end])
        if start >= p:
            return tuple(self.output_token_ids[start - p : end - p])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: end - p])


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
