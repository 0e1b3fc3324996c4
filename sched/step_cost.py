"""How long a step will take, from timings measured at start-up: the scheduler's model of the device.

A step's shape is (decode rows, prefill tiles), each padded up to a compiled bucket (the runner's
buckets.py), and its attention does work in proportion to the live context it reads, in items of
`item_tokens` context tokens per query tile or decode row (pallas_kernels.ragged_paged_attention_xla
walks such items). So a step's time is modelled as three measured terms:

    decode_s[bucket(decodes)]            a decode-only step of that bucket, rows at `calib_context`
  + prefill_s[bucket(tiles)]             what that many prefill tiles add at the start of a prompt
  + item_s x (items beyond those two)    deeper contexts than the calibration's

The first two are tables over the compiled buckets (padding is what a step pays for, so the
tables hold it); the third is the cost of one attention item, measured as a one-tile chunk deep
in a prompt against the same tile at its start. A one-tile chunk walks its items least
efficiently, so the item cost over-states what many deep tiles cost together (about 2x for 16
tiles at depth 4,096 on our CPU): the model errs on the side of shorter steps.

The scheduler only needs it to size prompt chunks so that a step that carries decodes stays within
a time (sched/step_budget.py); nothing here knows jax.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class StepCostModel:
    decode_s: tuple[tuple[int, float], ...]    # (decode rows bucket, seconds of a decode-only step)
    prefill_s: tuple[tuple[int, float], ...]   # (prefill tiles bucket, seconds those tiles add)
    item_s: float                              # seconds one attention item of context adds
    tile: int                                  # query rows per prefill tile
    item_tokens: int                           # context tokens per attention item
    calib_context: int                         # decode rows' context in the decode_s timings

    def __post_init__(self) -> None:
        for name in ("decode_s", "prefill_s"):
            table = getattr(self, name)
            keys = [k for k, _ in table]
            if not table or keys != sorted(set(keys)) or any(s < 0 for _, s in table):
                raise ValueError(f"{name} must be (bucket, seconds) pairs with increasing buckets and "
                                 f"seconds >= 0, got {table!r}")
        if self.item_s < 0 or self.tile < 1 or self.item_tokens < 1 or self.calib_context < 1:
            raise ValueError(f"bad StepCostModel {self!r}")

    @property
    def max_tiles(self) -> int:
        return self.prefill_s[-1][0]

    def decode_seconds(self, contexts: list[int] | tuple[int, ...]) -> float:
        """A decode-only step of decodes at these contexts (tokens each row attends to)."""
        if not contexts:
            return 0.0
        base = lookup_seconds(self.decode_s, len(contexts))
        per_row = _ceil_div(self.calib_context, self.item_tokens)
        extra = sum(max(0, _ceil_div(c, self.item_tokens) - per_row) for c in contexts)
        return base + self.item_s * extra

    def chunk_items(self, depth: int, n: int) -> tuple[int, int]:
        """(tiles, attention items beyond a chunk at depth 0) of a chunk of n tokens after `depth`."""
        tiles = _ceil_div(n, self.tile)
        extra = 0
        for i in range(tiles):
            end = (i + 1) * self.tile
            extra += _ceil_div(depth + end, self.item_tokens) - _ceil_div(end, self.item_tokens)
        return tiles, extra

    def prefill_seconds(self, tiles: int, extra_items: int) -> float:
        """What `tiles` prefill tiles with `extra_items` attention items beyond depth 0 add to a step."""
        if tiles <= 0:
            return 0.0
        if tiles > self.max_tiles:
            raise ValueError(f"{tiles} prefill tiles exceed the largest bucket {self.max_tiles}")
        return lookup_seconds(self.prefill_s, tiles) + self.item_s * extra_items


def lookup_seconds(table: tuple[tuple[int, float], ...], n: int) -> float:
    """The seconds of the smallest bucket holding n (the largest one beyond it): a step pays for
    its bucket's padding."""
    keys = [k for k, _ in table]
    i = min(bisect.bisect_left(keys, n), len(table) - 1)
    return table[i][1]
