"""The order a server warms its buckets in, and what it may serve while the rest still warm.

A server that loads and runs every bucket before it turns ready spends most of a warm start on
buckets its first requests will never use (37 at the default configuration). With
warm_up="background" the engine turns ready once a first, small set of buckets is warm and warms
the others in a thread of its own (background_warmup.py). Until every bucket is warm, a step runs
in the cheapest *warm* bucket that holds it (RunnerShapes.pick with `warm`), padded, and the
scheduler's step cap (`StepCap(seats, tokens)`) bounds steps to what some warm bucket holds:
as many seats as a warm decode-only and a warm mixed bucket hold, then as many tokens as a warm
mixed bucket of that many decode rows holds (`coverage_cap`).

The first set is what real traffic needs from its first step: the decode-only bucket of
max_num_seqs rows, and the mixed bucket of as many decode rows with room for one prefill tile
beside them. So at ready every seat is served, each decoding, with a prompt chunk beside them.
(Before, the first set was one seat and one tile: a server that took eight streams at ready
served one of them at a time until its stages reached more seats, minutes on a cold start.) Then,
in order: the other decode-only buckets, smallest first (most of a serving run's steps are
decode-only, each compiles in a fraction of a mixed one's time, and until its own size is warm a
step of fewer rows pays the padding); the mixed buckets of the most decode rows by prefill tiles
(each raises the cap's tokens: prompts come in larger chunks; the one of a full budget lifts it).
The rest, mixed buckets of fewer decode rows or fewer tiles than the first set's, only save a
prompt step's padding (a few decode rows beside its tiles, or a tile), and warming one takes a core from the steps for seconds: they warm only
while the engine is idle (`when_idle`), cheapest first. On the 2-core CPU, warming all of them
under load took the first 90 s after a warm start to 0.60x of the fully warm output rate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from jaxserve.runner.buckets import RunnerShapes, bucket_cost, pick_bucket
from jaxserve.runner.warmup import can_warm_up
from jaxserve.sched.step_cap import StepCap

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmPlan:
    first: tuple[tuple[int, int], ...]   # warm before the engine turns ready
    rest: tuple[tuple[int, int], ...]    # warmed in the background, in this order
    when_idle: frozenset[tuple[int, int]]   # of `rest`, those warmed only while no request is live
    max_num_seqs: int
    max_tiles: int                       # prefill tiles of a full token budget

    @property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        return self.first + self.rest

    def serving_first(self) -> "WarmPlan":
        """warm_up="serving": every bucket but the padding-only ones warm before ready."""
        needed = tuple(b for b in self.rest if b not in self.when_idle)
        fits = tuple(b for b in self.rest if b in self.when_idle)
        return WarmPlan(self.first + needed, fits, self.when_idle, self.max_num_seqs, self.max_tiles)


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


def warm_plan(shapes: RunnerShapes, *, max_num_seqs: int, max_num_batched_tokens: int) -> WarmPlan:
    """Every bucket a step can pick, the first set and then the background's order (above)."""
    tile = shapes.prefill_tile
    max_tiles = max(1, max_num_batched_tokens // tile)
    every = buckets_under(shapes, max_num_seqs, max_tiles)
    decode_only = shapes.pick(max_num_seqs, 0)
    # the seats' decode rows and one tile of prompt, in whole tiles of the step's token budget
    beside = min(max_tiles, -(-(max_num_seqs + tile) // tile))
    mixed = shapes.pick(max_num_seqs, beside)
    first = tuple(dict.fromkeys(b for b in (decode_only, mixed) if b in every))
    left = every - set(first)
    ordered = (sorted((b for b in left if b[1] == 0), key=bucket_cost)
               + sorted((b for b in left if b[1] > mixed[1] and b[0] == mixed[0]), key=bucket_cost))
    fits = sorted(left - set(ordered), key=bucket_cost)
    return WarmPlan(first, tuple(ordered + fits), frozenset(fits), max_num_seqs, max_tiles)


def coverage_cap(shapes: RunnerShapes, warm: frozenset[tuple[int, int]], max_num_seqs: int,
                 max_tiles: int) -> StepCap | None:
    """The step cap under which some warm bucket holds every step (None: every step of the
    configured limits): the most seats that a warm bucket holds as a decode-only step and, with a
    prefill tile, as a mixed one; then the most prefill tiles a warm mixed bucket holds beside
    that many decode rows. The cap's tokens are whole tiles: a step's decode tokens count in them,
    so a chunk beside the decodes never needs more tiles than the bucket has."""

    def holds(rows: int, tiles: int) -> bool:
        return any(d >= rows and p >= tiles and (p > 0 or tiles == 0) for d, p in warm)

    seats = max((s for s in range(1, max_num_seqs + 1) if holds(s, 0) and holds(s, 1)), default=0)
    if not seats:
        raise RuntimeError(f"no warm bucket holds a step (warm: {sorted(warm)}): no step may run yet")
    tiles = max(t for t in range(1, max_tiles + 1) if holds(seats, t))
    if seats == max_num_seqs and tiles == max_tiles:
        return None
    return StepCap(seats, tiles * shapes.prefill_tile)


class BucketReadiness:
    """Which buckets are warm, and the step cap that follows (coverage_cap). Marked from the
    warm-up thread, read from the step thread: `warm` is replaced whole on every mark, never
    changed in place. `on_change(warm, cap)` is called (in the marking thread) after each mark
    that made a bucket ready; `warm` is None once every bucket is."""

    def __init__(self, plan: WarmPlan, shapes: RunnerShapes,
                 on_change: Callable[[frozenset | None, StepCap | None], None] | None = None):
        if not plan.first:
            raise ValueError("no warm-up buckets")
        self.plan = plan
        self.shapes = shapes
        self.on_change = on_change
        self._lock = threading.Lock()
        self._ready: frozenset[tuple[int, int]] = frozenset()
        self._all = threading.Event()

    @property
    def total(self) -> int:
        return len(self.plan.buckets)

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    @property
    def all_ready(self) -> bool:
        return self._all.is_set()

    @property
    def warm(self) -> frozenset[tuple[int, int]] | None:
        """The buckets a step may run in (None: all of them)."""
        return None if self._all.is_set() else self._ready

    def is_ready(self, bucket: tuple[int, int]) -> bool:
        return bucket in self._ready

    @property
    def cap(self) -> StepCap | None:
        """The current cap; RuntimeError while no warm bucket holds a step."""
        if self._all.is_set():
            return None
        return coverage_cap(self.shapes, self._ready, self.plan.max_num_seqs, self.plan.max_tiles)

    def pending(self) -> list[tuple[int, int]]:
        """Buckets not ready yet, in warm-up order."""
        return [b for b in self.plan.buckets if b not in self._ready]

    def mark_ready(self, buckets: Iterable[tuple[int, int]]) -> None:
        with self._lock:
            before = self._ready
            self._ready = before | set(buckets)
            if self._ready == before:
                return
            if all(b in self._ready for b in self.plan.buckets):
                self._all.set()
            warm, cap = self.warm, self.cap
        if self.on_change is not None:
            self.on_change(warm, cap)

    def wait_all(self, timeout: float | None = None) -> bool:
        return self._all.wait(timeout)

    def describe(self) -> str:
        try:
            cap = self.cap
        except RuntimeError:
            return f"{self.num_ready}/{self.total} buckets ready (not serving yet)"
        where = "no cap" if cap is None else f"steps capped at {cap.seats} seats, {cap.tokens} tokens"
        return f"{self.num_ready}/{self.total} buckets ready ({where})"
