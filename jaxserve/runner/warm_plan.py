"""The order a server warms its buckets in, and what it may serve while the rest still warm.

A server that loads and runs every bucket before it turns ready spends most of a warm start on
buckets its first requests will never use (37 at the default configuration; a first request
steps in two). With warm_up="background" the engine turns ready once the buckets of a first,
small *stage* are warm, and warms the others in a thread of its own (background_warmup.py),
stage after stage. Each stage is a cap on the step, `StepCap(seats, tokens)`: a step of at most
that many running requests and batched tokens can pick only buckets of that stage or an earlier
one, so while the scheduler holds to the cap no step needs a bucket that is not warm yet. The
cap rises as each stage completes and goes away with the last.

Stages grow the prompt budget of one seat first (a lone first request gets its whole prompt
into few steps), then the seats, each at the full budget: (1 seat, first_tiles tiles), (1 seat,
each larger tile count), (2 seats, all tiles), (4, all), ... max_num_seqs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jaxserve.runner.buckets import RunnerShapes, pick_bucket
from jaxserve.runner.warmup import can_warm_up
from jaxserve.sched.step_cap import StepCap

log = logging.getLogger(__name__)

# The first stage's prompt budget, in tiles: one tile of 8 tokens, so the engine turns ready after
# 2 buckets, (1, 0) and (1, 1), and a first request's prompt runs in 8-token steps until the next
# stages are warm (seconds: each bucket of a warm start loads and runs in about 1-3 s on the loaded
# 2-core CPU). At 4 tiles (4 buckets: (1, 2) and (1, 4) too) a warm start spent 7.4 s loading and
# 5.6 s in first runs before ready (load average 3.8; docs/benchmarks.md "Start-up").
FIRST_STAGE_TILES = 1


@dataclass(frozen=True, slots=True)
class WarmStage:
    cap: StepCap | None                      # None: the last stage, no cap at all
    buckets: tuple[tuple[int, int], ...]     # buckets first needed by this stage, cheapest first


def buckets_under(shapes: RunnerShapes, seats: int, tiles: int) -> set[tuple[int, int]]:
    """Every bucket a step of at most `seats` decode rows and `tiles` prefill tiles can pick
    (RunnerShapes.pick): a step of S running requests has at most S decode rows (a decode or a
    one-token chunk each), and a budget of T tiles' tokens carries at most T tiles."""
    decode_only = shapes.decode_only_buckets or shapes.decode_buckets
    out: set[tuple[int, int]] = set()
    for p in _image(shapes.prefill_buckets, 0, tiles):
        rows = decode_only if p == 0 else shapes.decode_buckets
        out |= {(d, p) for d in _image(rows, 1, seats)}
    return {b for b in out if can_warm_up(shapes, b)}


def _image(sizes, lo: int, hi: int) -> list[int]:
    """{pick_bucket(n, sizes) for lo <= n <= hi}: pick is a monotone step function, so that is every
    size from pick(lo) up to pick(hi)."""
    first, last = pick_bucket(lo, sizes), pick_bucket(hi, sizes)
    return [s for s in sizes if first <= s <= last]


def warm_stages(shapes: RunnerShapes, *, max_num_seqs: int, max_num_batched_tokens: int,
                first_tiles: int = FIRST_STAGE_TILES) -> list[WarmStage]:
    """The stages, in order; together they hold every bucket a step can pick."""
    tile = shapes.prefill_tile
    max_tiles = max_num_batched_tokens // tile
    decode_only = shapes.decode_only_buckets or shapes.decode_buckets
    first_tiles = max(1, min(first_tiles, max_tiles))
    tile_levels = [t for t in shapes.prefill_buckets if first_tiles < t < max_tiles]
    seat_levels = [s for s in decode_only if 1 < s < max_num_seqs]
    caps = ([(1, first_tiles)] + [(1, t) for t in tile_levels] + [(1, max_tiles)]
            + [(s, max_tiles) for s in seat_levels] + [(max_num_seqs, max_tiles)])
    stages, seen = [], set()
    for i, (seats, tiles) in enumerate(dict.fromkeys(caps)):
        last = seats == max_num_seqs and tiles == max_tiles
        new = buckets_under(shapes, seats, tiles) - seen
        seen |= new
        if not new and not last:
            continue
        cap = None if last else StepCap(seats, tiles * tile)
        stages.append(WarmStage(cap, tuple(sorted(new, key=_cost))))
    return stages


def _cost(bucket: tuple[int, int]) -> tuple[int, int]:
    # query rows decide what loading and a first run cost; a prefill tile is 8 rows
    d, p = bucket
    return (d + 8 * p, p)


class BucketReadiness:
    """Which buckets are warm, and the step cap that follows: the cap of the last stage whose
    buckets (and every earlier stage's) are all warm. Marked from the warm-up thread, read from
    the step thread; `on_cap(cap)` is called (in the marking thread) whenever the cap changes."""

    def __init__(self, stages: list[WarmStage], on_cap: Callable[[StepCap | None], None] | None = None):
        if not stages:
            raise ValueError("no warm-up stages")
        self.stages = stages
        self.on_cap = on_cap
        self._lock = threading.Lock()
        self._ready: set[tuple[int, int]] = set()
        self._complete = 0          # stages whose buckets, and every earlier stage's, are all ready
        self._all = threading.Event()

    @property
    def total(self) -> int:
        return sum(len(s.buckets) for s in self.stages)

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def all_ready(self) -> bool:
        return self._all.is_set()

    def is_ready(self, bucket: tuple[int, int]) -> bool:
        return bucket in self._ready

    @property
    def cap(self) -> StepCap | None:
        """The current cap; before the first stage is ready there is none that admits a step."""
        if self._complete == 0:
            raise RuntimeError("the first warm-up stage is not ready: no step may run yet")
        return self.stages[self._complete - 1].cap

    def pending(self) -> list[tuple[int, int]]:
        """Buckets not ready yet, in warm-up order (stage by stage)."""
        return [b for s in self.stages for b in s.buckets if b not in self._ready]

    def mark_ready(self, buckets: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            self._ready.update(buckets)
            before = self._complete
            while self._complete < len(self.stages) and all(
                    b in self._ready for b in self.stages[self._complete].buckets):
                self._complete += 1
            changed = self._complete != before
            cap = self.stages[self._complete - 1].cap if self._complete else None
        if changed:
            if self._complete == len(self.stages):
                self._all.set()
            if self.on_cap is not None:
                self.on_cap(cap)

    def wait_all(self, timeout: float | None = None) -> bool:
        return self._all.wait(timeout)

    def describe(self) -> str:
        if self._complete == 0:
            where = "not serving yet"
        else:
            cap = self.stages[self._complete - 1].cap
            where = "no cap" if cap is None else f"steps capped at {cap.seats} seats, {cap.tokens} tokens"
        return f"{self.num_ready}/{self.total} buckets ready ({where})"
