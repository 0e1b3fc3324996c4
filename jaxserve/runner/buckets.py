"""Shape buckets: the finite set of step shapes compiled at start-up.

A step's shape is (decode rows, prefill tiles): decodes are one query row each, prefill chunks
are packed in tiles of `prefill_tile` rows (see pallas_kernels.ragged_paged_attention_xla).
Padding rows are computed and discarded; the bucket lists trade that waste against compile time.
"""

from __future__ import annotations

import bisect
from typing import Sequence


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest compiled size that holds n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def geometric_buckets(start: int, stop: int, factor: int = 4) -> tuple[int, ...]:
    """start, start*factor, ... then stop itself; a step within 1.5x of stop is dropped (the
    padding it saves is not worth a compile)."""
    out = []
    b = start
    while b * 3 < stop * 2:
        out.append(b)
        b *= factor
    out.append(stop)
    return tuple(out)


def default_decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    return geometric_buckets(1, max_num_seqs)


def max_prefill_tiles(max_num_batched_tokens: int, prefill_tile: int) -> int:
    """Most tiles in a step: the scheduler charges every multi-token chunk whole tiles
    (SchedulerConfig.chunk_granularity = prefill_tile), so they fit the token budget."""
    return max_num_batched_tokens // prefill_tile


def default_prefill_buckets(max_tiles: int) -> tuple[int, ...]:
    # Powers of two: a step beside decodes usually carries one ITL-sized chunk of a few tiles
    # (engine/chunk_policy.py), and rounding 2 tiles up to 4 would double its cost.
    return (0,) + geometric_buckets(1, max_tiles, factor=2)
