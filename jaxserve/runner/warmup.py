"""Warm-up: every step a request will use runs once before that request, on the null block.

The first execution of an XLA:CPU executable costs 0.2-1 s more than later ones (measured,
embedded model: 8 decodes + one tile 563 ms, then 144 ms; under load a (4 decodes, 4 tiles) step
1.33 s, then 0.47 s). A profile puts that time in building the runtime pipelines of the
executable's YNN fusions (slinky), which XLA does lazily, at the first run, once per loaded
executable (a deserialized copy pays it again); an all-zero input does not avoid it. Turning the
YNN fusions off (XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=) removed most of it but made a
4-decode step about 3x slower in one loaded measurement, so the first run stays. While serving it
would stall every request in the step that first needs a bucket: the step after the last long
prompt finishes, the first step with 4 decodes, ...

So every step is run once before a request can need it: all of them at start-up (the server),
or the ones a known set of requests can need (`buckets_for_requests`, for `jaxserve generate`).
The runs write only the null block (block 0, where padding rows write anyway), so a warm-up
leaves every other block as it was and may run between steps at any time the engine is idle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import jax

from jaxserve.runner.buckets import RunnerShapes, pick_bucket
from jaxserve.runner.scratch import scratch_request, scratch_step

log = logging.getLogger(__name__)


def warm_up(runner, buckets: Iterable[tuple[int, int]] | None = None, *, progress: bool = False) -> "WarmUpReport":
    """Load (where not loaded yet) and run once each of `buckets` (default: every bucket), running
    each as soon as it is loaded while the next ones load."""
    from jaxserve.runner.model_runner import progress_bar

    buckets = sorted(b for b in (runner.shapes.buckets() if buckets is None else set(buckets))
                     if can_warm_up(runner.shapes, b))
    report = WarmUpReport()
    with progress_bar(progress, len(buckets), "warming up") as bar:
        def run(bucket, _executable) -> None:
            t = time.perf_counter()
            try:
                runner.execute(warm_up_step(runner.shapes, bucket))
            except jax.errors.JaxRuntimeError as e:
                # a kept executable that loads but cannot run (seen: XLA:CPU copies that lost a
                # function, "Function ... not found"): never let a cache entry stop a start
                log.warning("step %s from the executable cache failed its first run (%s); compiling it", bucket, e)
                runner.recompile(bucket)
                runner.execute(warm_up_step(runner.shapes, bucket))
            report.ran.append(bucket)
            report.run_seconds += time.perf_counter() - t
            bar.update(1)

        report.load_seconds = runner.load_executables(buckets, on_loaded=run) - report.run_seconds
    return report


@dataclass(slots=True)
class WarmUpReport:
    """Which buckets ran, and the seconds spent loading (waiting for executables) and running."""

    ran: list[tuple[int, int]] = field(default_factory=list)
    load_seconds: float = 0.0
    run_seconds: float = 0.0


def warm_up_step(shapes: RunnerShapes, bucket: tuple[int, int]):
    """A scratch step that packs into exactly `bucket`: D one-token decodes at context 1 and P
    full tiles, on the null block, as prompts no longer than a request's can be (a block table
    holds max_model_len tokens)."""
    D, P = bucket
    rows = [scratch_request(f"warmup-{i}", 1, 0, block_size=shapes.block_size, null_blocks=True)
            for i in range(D)]
    tiles_per_prompt = (shapes.max_model_len - 1) // shapes.prefill_tile
    left = P
    while left:
        n = min(left, tiles_per_prompt)
        rows.append(scratch_request(f"warmup-prompt-{left}", n * shapes.prefill_tile, 0,
                                    block_size=shapes.block_size, null_blocks=True))
        left -= n
    return scratch_step(rows)


def can_warm_up(shapes: RunnerShapes, bucket: tuple[int, int]) -> bool:
    """False for a prefill bucket when not even one tile fits a prompt (max_model_len <= tile):
    no request can step in it either."""
    return bucket[1] == 0 or shapes.max_model_len - 1 >= shapes.prefill_tile


def buckets_for_requests(shapes: RunnerShapes, requests: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every bucket the first requests of an engine can step in: `requests` holds one (prompt
    tokens, most output tokens) pair per sequence (n > 1 samples count n times).

    One sequence alone is predicted exactly: its prompt in one step (when it fits the step's
    token budget), then one decode per step (also when it wants one token: the one-step-ahead
    loop may schedule a step beyond a request's last). It cannot be preempted (the door admits
    only a request the KV pool can hold whole), and an engine's first request finds no cached
    prefix that would shorten its prompt. Otherwise the answer is a superset by bounds: a step
    carries at most one decode row per sequence, and prefill tiles at most for every token of
    every sequence (a preempted request recomputes its prompt and outputs), never more than the
    step's token budget; chunking can make any smaller step, so every smaller bucket counts."""
    if not requests:
        return []
    tile = shapes.prefill_tile
    decode_only = shapes.decode_only_buckets or shapes.decode_buckets
    one_decode = (pick_bucket(1, decode_only), 0)
    if len(requests) == 1:
        prompt_tiles = -(-requests[0][0] // tile)
        if requests[0][0] == 1:                          # a one-token prompt steps as a decode row
            return [one_decode]
        if prompt_tiles <= shapes.prefill_buckets[-1]:
            prefill = (pick_bucket(1, shapes.decode_buckets), pick_bucket(prompt_tiles, shapes.prefill_buckets))
            return sorted({one_decode, prefill})
    seqs = len(requests)
    tiles = min(sum(-(-(p + o) // tile) for p, o in requests), shapes.prefill_buckets[-1])
    most_p = pick_bucket(tiles, shapes.prefill_buckets)
    most_mixed_d = pick_bucket(min(seqs, shapes.decode_buckets[-1]), shapes.decode_buckets)
    most_decode_only_d = pick_bucket(min(seqs, decode_only[-1]), decode_only)
    return [(d, p) for d, p in shapes.buckets()
            if (p == 0 and d <= most_decode_only_d) or (0 < p <= most_p and d <= most_mixed_d)]
