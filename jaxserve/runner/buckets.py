"""Shape buckets: the finite set of step shapes compiled at start-up.

A step's shape is (decode rows, prefill tiles): decodes are one query row each, prefill chunks
are packed in tiles of `prefill_tile` rows (see pallas_kernels.ragged_paged_attention_xla).
Padding rows are computed and discarded; the bucket lists trade that waste against compile time.

Decode-only steps (no prefill tile) get their own, finer list of row counts. They are most of
a serving run's steps (every step once the prompts are in), a padded row costs as much as a
real one (the matmuls are compute-bound at these sizes on the CPU: about 2 ms per row for the
embedded model), and a decode-only step compiles in a fraction of a mixed one's time. Mixed
steps keep the coarse list: its product with the prefill tile counts is what start-up compiles.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, slots=True)
class RunnerShapes:
    block_size: int
    max_model_len: int
    prefill_tile: int
    decode_buckets: tuple[int, ...]          # decode rows of steps that carry prefill tiles
    prefill_buckets: tuple[int, ...]         # prefill tiles per step (0 = a decode-only step)
    decode_only_buckets: tuple[int, ...] = ()  # decode rows of decode-only steps (() = decode_buckets)

    @property
    def table_width(self) -> int:
        # a prefill tile's padding rows may reach max_model_len + tile - 1
        return -(-(self.max_model_len + self.prefill_tile) // self.block_size)

    @property
    def max_decode_rows(self) -> int:
        return max(self.decode_buckets[-1], (self.decode_only_buckets or self.decode_buckets)[-1])

    def buckets(self) -> list[tuple[int, int]]:
        mixed = [p for p in self.prefill_buckets if p > 0]
        out = list(itertools.product(self.decode_buckets, mixed))
        if 0 in self.prefill_buckets:
            out += [(d, 0) for d in self.decode_only_buckets or self.decode_buckets]
        return sorted(out)

    def pick(self, decode_rows: int, prefill_tiles: int,
             warm: frozenset[tuple[int, int]] | None = None) -> tuple[int, int]:
        """The compiled (D, P) bucket holding a step of that many decode rows and prefill tiles:
        the smallest, or with `warm` (the buckets ready while the rest still warm:
        runner/warm_plan.py) the cheapest warm one that holds it, padded. A decode-only step may
        run in a mixed bucket (its tiles all padding). With no warm bucket holding it, the smallest
        (it loads on demand: the step cap keeps a serving engine from asking)."""
        P = pick_bucket(prefill_tiles, self.prefill_buckets)
        rows = self.decode_only_buckets if P == 0 and self.decode_only_buckets else self.decode_buckets
        exact = pick_bucket(max(decode_rows, 1), rows), P
        if warm is None or exact in warm:
            return exact
        holding = [b for b in warm if b[0] >= decode_rows and b[1] >= prefill_tiles]
        return min(holding, key=bucket_cost) if holding else exact


def bucket_cost(bucket: tuple[int, int]) -> tuple[int, int]:
    """What a step in the bucket costs, as an order: its query rows (a prefill tile is 8 rows)."""
    d, p = bucket
    return (d + 8 * p, p)


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


def default_decode_only_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, then powers of two and the midpoints between them (4, 6, 8, 12, 16, 24, 32, 48, ...),
    and max_num_seqs itself: a decode-only step pads less than a third of its rows."""
    out = [1, 2]
    b = 4
    while b < max_num_seqs:
        out += [b, b * 3 // 2]
        b *= 2
    return tuple(x for x in out if x < max_num_seqs) + (max_num_seqs,)


def max_prefill_tiles(max_num_batched_tokens: int, prefill_tile: int) -> int:
    """Most tiles in a step: the scheduler charges every multi-token chunk whole tiles
    (SchedulerConfig.chunk_granularity = prefill_tile), so they fit the token budget."""
    return max_num_batched_tokens // prefill_tile


def default_prefill_buckets(max_tiles: int) -> tuple[int, ...]:
    # Powers of two: a step beside decodes usually carries one ITL-sized chunk of a few tiles
    # (engine/chunk_policy.py), and rounding 2 tiles up to 4 would double its cost.
    return (0,) + geometric_buckets(1, max_tiles, factor=2)
