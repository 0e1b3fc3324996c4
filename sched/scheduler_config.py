"""The scheduler's knobs: what a user sets (SchedulerOptions, the engine config's `scheduler`
section) and what the engine derives at start-up from its runner and measurements
(SchedulerConfig adds those: the KV pool, the chunk policy, step costs). Both frozen, validated once.

The engine builds a SchedulerConfig from its options and the derived parts
(`SchedulerConfig.from_options`): the options pass through whole, never field by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxserve.sched.speculation import SpeculativeConfig
from jaxserve.sched.step_budget import ServiceObjectives
from jaxserve.sched.step_cost import StepCostModel


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _non_negative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _option(default, help: str, **kw):
    # the help text is the flag's (jaxserve/engine_args.py builds the CLI from these fields);
    # per_engine: a second engine on the same compiled runner may set it anew (the runner's
    # buckets are sized by max_num_seqs and max_num_batched_tokens, never by the others)
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerOptions:
    """How requests share the steps: seats, the token budget, queueing and preemption."""

    max_num_seqs: int = _option(32, "most sequences in one step")
    max_num_batched_tokens: int = _option(512, "token budget of one step (prefill chunks + decodes)")
    enable_chunked_prefill: bool = _option(True, "split long prompts into chunks across steps", per_engine=True)
    max_num_partial_prefills: int = _option(1, "most prompts left mid-prefill after a step (0: no cap)",
                                            per_engine=True)
    starvation_steps: int = _option(32, "a request waiting this many steps is never overtaken again",
                                    per_engine=True)
    scheduling_policy: str = _option("fcfs", "fcfs, or priority (lower value = more urgent)",
                                     choices=("fcfs", "priority"), per_engine=True)
    priority_weight_base: float = _option(2.0, "priority policy: class p gets a fair share of weight base ** -p",
                                          per_engine=True)
    max_waiting_requests: int = _option(
        0, "beyond this many requests waiting for a seat (requests that free seats will take at the next step do "
           "not count) new ones get Overloaded (0: unbounded)", per_engine=True)
    kv_watermark: float = _option(0.01, "share of KV blocks admissions leave free for running requests",
                                  per_engine=True)
    preemption_mode: str = _option(
        "auto", "recompute, swap (to host memory), or auto (by a cost model measured at start-up; recompute "
                "without a host pool)", choices=("auto", "recompute", "swap"), per_engine=True)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "starvation_steps"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(f"enable_chunked_prefill must be a bool, got {self.enable_chunked_prefill!r}")
        for name in ("max_num_partial_prefills", "max_waiting_requests"):
            _non_negative_int(name, getattr(self, name))
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be 'recompute', 'swap' or 'auto', got {self.preemption_mode!r}")
        if not (isinstance(self.priority_weight_base, (int, float)) and self.priority_weight_base >= 1):
            raise ValueError(f"priority_weight_base must be a number >= 1, got {self.priority_weight_base!r}")
        if not (isinstance(self.kv_watermark, (int, float)) and not isinstance(self.kv_watermark, bool)
                and 0 <= self.kv_watermark < 1):
            raise ValueError(f"kv_watermark must be a number in [0, 1), got {self.kv_watermark!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig(SchedulerOptions):
    """The options and what the engine derived for them at start-up."""

    num_blocks: int  # KV blocks the scheduler may use, including the reserved null block 0
    block_size: int = 16
    max_model_len: int = 2048  # prompt + output tokens of one request
    long_prefill_token_threshold: int = 0  # max tokens of one request per step; 0 = no cap
    # Max prompt tokens of one request in a step that also carries decodes (0 = no cap): the
    # chunk an inter-token-latency budget allows. A step with nobody decoding has no ITL to
    # protect, so there a prompt may take the whole budget.
    decode_step_prefill_cap: int = 0
    # Finer caps by the number of decodes in the step: (at most this many decodes, cap) pairs,
    # bounds increasing; a step with more decodes than the last bound uses decode_step_prefill_cap.
    # Fewer decoders make a cheaper decode-only step, so the same ITL ratio allows a smaller chunk.
    decode_step_prefill_caps: tuple[tuple[int, int], ...] = ()
    enable_prefix_caching: bool = True
    # A chunk of n > 1 tokens costs ceil(n / chunk_granularity) * chunk_granularity of the budget:
    # the runner computes prefill chunks in tiles of that many rows (1 = plain token counting).
    chunk_granularity: int = 1
    # Service objectives and the step-time model that turns them into prompt chunk sizes
    # (step_budget.py): a step that carries decodes holds the prompt tokens its time allowance
    # admits, shared by every prompt in the step. Both or neither; None = token caps only.
    objectives: ServiceObjectives | None = None
    step_cost: StepCostModel | None = None

    # ---- scheduling under pressure ----
    admission_output_share: float = 0.5  # share of a request's remaining max_tokens counted as projected KV use
    num_host_blocks: int = 0  # host-memory pool: swapped-out blocks (swap and auto modes), and the host tier
    # the prefix cache's host tier: blocks it evicts from the device move to the host pool and stay
    # findable (prefix_cache.py); needs prefix caching and a host pool
    enable_kv_offload: bool = False
    swap_crossover_tokens: int = 256  # auto: swap when recompute would redo at least this many tokens
    # record the prefix cache's changes as KV events (kv_events.py), for the engine to publish
    kv_events: bool = False

    # ---- speculative decoding (speculation.py) ----
    speculation: SpeculativeConfig | None = None
    max_decode_rows: int = 0  # decode rows (decodes + drafts) a step holds; 0 = max_num_seqs
    # (decode rows bucket, seconds of a decode-only step): what extra rows cost; () = rows are free
    decode_step_seconds: tuple[tuple[int, float], ...] = ()
    # (requests bucket, seconds of one decode step of the draft model): method draft_model
    draft_step_seconds: tuple[tuple[int, float], ...] = ()
    # LoRA adapters' device slots a request must hold to run under one (lora_slots.py); 0 = none served
    max_loras: int = 0

    @classmethod
    def from_options(cls, options: SchedulerOptions, **derived) -> "SchedulerConfig":
        """The options as they are, with what the engine derived (a derived value may replace an
        option the runner cannot serve: preemption_mode without swap space)."""
        mine = {f.name: getattr(options, f.name) for f in dataclasses.fields(SchedulerOptions)}
        return cls(**{**mine, **derived})

    def prefill_cap_beside(self, num_decodes: int) -> int:
        """Most prompt tokens of one request in a step that carries num_decodes > 0 decodes (0 = no cap)."""
        for bound, cap in self.decode_step_prefill_caps:
            if num_decodes <= bound:
                return cap
        return self.decode_step_prefill_cap

    def __post_init__(self) -> None:
        SchedulerOptions.__post_init__(self)
        for name in ("num_blocks", "block_size", "max_model_len", "chunk_granularity"):
            _positive_int(name, getattr(self, name))
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        for name in ("long_prefill_token_threshold", "decode_step_prefill_cap"):
            _non_negative_int(name, getattr(self, name))
        bounds = [b for b, _ in self.decode_step_prefill_caps]
        if (bounds != sorted(set(bounds)) or any(not isinstance(b, int) or not isinstance(c, int) or b < 1 or c < 1
                                                for b, c in self.decode_step_prefill_caps)):
            raise ValueError(f"decode_step_prefill_caps must be (decodes, cap) pairs of positive ints with "
                             f"increasing decodes, got {self.decode_step_prefill_caps!r}")
        for name in ("num_host_blocks", "swap_crossover_tokens"):
            _non_negative_int(name, getattr(self, name))
        if self.preemption_mode == "swap" and self.num_host_blocks < 1:
            raise ValueError(
                f"preemption_mode={self.preemption_mode!r} needs a host pool: num_host_blocks must be >= 1, "
                f"got {self.num_host_blocks}"
            )
        if self.enable_kv_offload and (self.num_host_blocks < 1 or not self.enable_prefix_caching):
            raise ValueError(f"enable_kv_offload needs prefix caching and a host pool (num_host_blocks >= 1), got "
                             f"enable_prefix_caching={self.enable_prefix_caching}, num_host_blocks={self.num_host_blocks}")
        v = self.admission_output_share
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
            raise ValueError(f"admission_output_share must be a number in [0, 1], got {v!r}")
        if (self.objectives is None) != (self.step_cost is None):
            raise ValueError("objectives and step_cost go together: the objectives are turned into chunk sizes "
                             "by the step-time model")
        if self.step_cost is not None and self.step_cost.tile != self.chunk_granularity:
            raise ValueError(f"step_cost.tile={self.step_cost.tile} must equal chunk_granularity="
                             f"{self.chunk_granularity} (both are the runner's prefill tile)")
        if self.max_decode_rows and self.max_decode_rows < self.max_num_seqs:
            raise ValueError(f"max_decode_rows={self.max_decode_rows} must be >= max_num_seqs={self.max_num_seqs} "
                             f"(or 0)")
        rows = [r for r, _ in self.decode_step_seconds]
        if rows != sorted(set(rows)) or any(s < 0 for _, s in self.decode_step_seconds):
            raise ValueError(f"decode_step_seconds must be (rows, seconds) pairs with increasing rows, got "
                             f"{self.decode_step_seconds!r}")
        if not self.enable_chunked_prefill:
            if self.objectives is not None:
                raise ValueError("objectives size prompt chunks; they need enable_chunked_prefill=True")
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"with enable_chunked_prefill=False a prompt is scheduled whole, so "
                    f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                    f"max_model_len={self.max_model_len}"
                )
            g = self.chunk_granularity
            longest = -(-(self.max_model_len - 1) // g) * g  # prompt + outputs, charged in whole tiles
            if self.max_num_batched_tokens < longest:
                raise ValueError(
                    f"with enable_chunked_prefill=False and chunk_granularity={g}, a whole prompt of "
                    f"{self.max_model_len - 1} tokens costs {longest} of the budget, so "
                    f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= {longest}"
                )
            for name in ("long_prefill_token_threshold", "decode_step_prefill_cap", "decode_step_prefill_caps"):
                if getattr(self, name):
                    raise ValueError(
                        f"{name}={getattr(self, name)} cuts prompts into chunks; it needs "
                        f"enable_chunked_prefill=True"
                    )

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def watermark_blocks(self) -> int:
        return int(self.kv_watermark * self.num_usable_blocks)
