"""What one step is as data at the runner's edges: the host inputs it ran from (`StepInputs`, what
a multi-host leader mirrors), the handle of a dispatched step (`StepHandle`) and what the host
reads back from it (`ModelRunnerOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.runner.sampled_tokens import SampledToken


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    # request id -> the token ids it sampled in the step, in order (one per step; a verification
    # of speculative guesses gives the guesses kept and one more)
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> the same tokens with their logprobs, only for requests that asked for
    # logprobs (a SampledToken per token costs ~0.5 us: not made for the others)
    logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)
    # step feature name -> what it read for this step (step_feature.py; only features that ran):
    # "prompt_logprobs" request id -> PromptLogprobChunk, "pooling" request id -> PooledChunk,
    # "expert_counts" [L_moe, E] routed tokens
    features: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepHandle:
    """A dispatched step; its outputs may still be computing on the device."""

    sample_rows: tuple[tuple[str, int], ...] = ()   # (request id, logits row) of requests that sample
    sampler_out: dict | None = None                  # the sampler's device arrays
    want_logprobs: np.ndarray | None = None          # per logits row
    drafts: dict[str, tuple[int, ...]] | None = None  # request id -> guesses it verifies (batch.PackedStep)
    features: dict = field(default_factory=dict)     # feature name -> what its run() dispatched


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One dispatched step as host data: its block operations, its packed arrays (None: the step
    only moves blocks) and its features' rows. What a multi-host leader sends the other hosts
    (parallel/distributed.py), less the features that are not mirrored."""

    swap_out: tuple = ()
    swap_in: tuple = ()
    block_copies: tuple = ()
    packed: object = None                # batch.PackedStep
    features: dict = field(default_factory=dict)   # feature name -> its pack() of this step
