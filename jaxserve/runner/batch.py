"""Packing a SchedulerOutput into the fixed-shape arrays of one compiled step.

Layout of the T = D + P * tile query rows of a (D, P) bucket:
  rows [0, D)          one decode (or one-token chunk) per row
  rows [D, D + P*tile) prefill chunks, each cut into tiles of `tile` rows; a tile is one slot of
                       the uniform-slot attention, with kv_len = its last row's position + 1
A request verifying speculative guesses (ScheduledRequest.num_draft_tokens = k) takes k + 1
decode rows, one per token, each attending to the context up to and including its own token
(the step writes every row's K/V before attention), and every one of them samples; the runner
keeps the guesses that each equal the token sampled the row before (model_runner.collect).
Padding rows read the null block and write their K/V into it; their outputs are discarded.
A placeholder token (one the previous step sampled, not yet known on the host) gets its row's
`token_src` = the previous step's logits row; the step reads the id there from the previous
step's sampled tokens, on the device. Other rows have token_src = -1. `lora_slots [T]` is each
row's LoRA adapter slot (ScheduledRequest.lora_slot; 0: the base model, and every padding row).
Everything here is numpy on the host; the arrays go to the device once per step. The packer is
runner/persistent_batch.py (its seats keep what did not change since the last step); the tests'
oracle, tests/packing_oracle.py, packs a step from nothing in this layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.runner.buckets import RunnerShapes


@dataclass(frozen=True, slots=True)
class PackedStep:
    bucket: tuple[int, int]                 # (decode rows D, prefill tiles P)
    arrays: dict[str, np.ndarray]           # the step's inputs
    sampling: dict[str, np.ndarray]         # the sampler's inputs, one row per logits row
    sample_rows: tuple[tuple[str, int], ...]  # (request_id, logits row) for requests that sample
    # request id -> its guesses, for requests verifying some: their logits rows are sample_rows'
    # row and the k after it
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


def num_tiles(n: int, tile: int) -> int:
    return -(-n // tile)


def bucket_for(sched_out, shapes: RunnerShapes) -> tuple[int, int]:
    d = sum(r.decode_rows for r in sched_out.requests)
    p = sum(num_tiles(len(r.token_ids), shapes.prefill_tile) for r in sched_out.requests if not r.decode_rows)
    return shapes.pick(d, p)


def sample_rows_bucket(D: int, P: int) -> int:
    """Logits rows of a (D, P) step: a power of two holding D + P (the sampler's buckets)."""
    return 1 << (D + P - 1).bit_length()


def batch_shapes(D: int, P: int, *, tile: int, table_width: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of a (D, P) bucket's step inputs, for ahead-of-time compilation."""
    T, R = D + P * tile, sample_rows_bucket(D, P)
    i32 = np.dtype(np.int32)
    return dict(
        input_ids=((T,), i32), token_src=((T,), i32), positions=((T,), i32), slot_mapping=((T,), i32),
        dec_kv_lens=((D,), i32), dec_tables=((D, table_width), i32), dec_num=((1,), i32),
        pre_kv_lens=((P,), i32), pre_tables=((P, table_width), i32), pre_num=((1,), i32),
        logits_rows=((R,), i32), lora_slots=((T,), i32),
    )
