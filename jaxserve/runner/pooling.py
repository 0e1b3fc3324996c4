"""Pooling for embeddings: the sums of a step's final hidden states over each pooling request's rows.

A pooling request (`PoolingParams`, `LLM.embed`, /v1/embeddings) is a prompt that runs through the
same scheduler and steps as any other: chunked, batched beside generation, and ended after its
prompt by the one token every request samples (dropped). The steps of an engine built with
`enable_embeddings` return every row's final-normed hidden state, as for prompt logprobs (the same
program, `ModelRunner.returns_hidden`); on a step that carries pooling rows the runner calls
`pooled_sums` on them: per pooling request of the step, the float32 sum of its rows. "mean" asks
for every prompt row of every chunk, "last" for the prompt's last row only (in the chunk that
samples). The host adds a request's chunks up and divides, normalizes (engine/pooled_embedding.py).

Why a compiled function and not numpy on the host: the host would need the whole [T, D] hidden
state of the step (T = D + P * tile rows, e.g. 2,048 x 4,096 = 16 MB in bfloat16) to read a few
rows, and gathering those rows on the device by index would compile per shape while serving. The
function here is compiled once per step row count at start-up (as prompt logprobs' is), and only
[S, D] float32 sums come back, S the most requests a step of that row count can hold.

Prompt positions served from the prefix cache have no rows, so a pooling request never reads the
cache (sched: `Request.skip_reading_prefix_cache`); its own blocks still enter it for others.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.executables import ExecutableStore
from jaxserve.runner.step_feature import StepFeature, hidden_dtype, step_rows


def pooled_sums(hidden: jax.Array, segments: jax.Array, *, num_segments: int) -> jax.Array:
    """hidden [T, D], segments [T] int32 (the slot each row is summed into; num_segments: none)
    -> [num_segments, D] float32 sums. The extra slot takes every row nobody asked for."""
    sums = jax.ops.segment_sum(hidden.astype(jnp.float32), segments, num_segments=num_segments + 1)
    return sums[:num_segments]


@dataclass(frozen=True, slots=True)
class PoolingRows:
    """A step's pooling work, packed on the host."""

    rows: int                                  # T, the step's query rows
    segments: np.ndarray                       # [T] int32: each row's slot; num_segments: none
    # (request id, prompt position of its first row, how many rows, its slot)
    reads: tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class PooledChunk:
    """The summed hidden states of one request's consecutive prompt positions [first, first + count)."""

    first: int
    count: int
    total: np.ndarray              # [D] float32


def request_rows(sched_out, bucket: tuple[int, int], tile: int) -> Iterator[tuple[object, int]]:
    """(scheduled request, its first row) in the layout runner/batch.py packs: decode rows (and
    one-token chunks, and verifications) first, in order, then prefill chunks in whole tiles."""
    D, _ = bucket
    d = p = 0
    for req in sched_out.requests:
        n = len(req.token_ids)
        if req.num_draft_tokens or n == 1:
            yield req, d
            d += n
        else:
            yield req, D + p * tile
            p += -(-n // tile)


def max_segments(buckets, tile: int) -> dict[int, int]:
    """Step row count -> the most requests one step of that many rows holds (D + P)."""
    most: dict[int, int] = {}
    for b in buckets:
        t = step_rows(b, tile)
        most[t] = max(most.get(t, 0), b[0] + b[1])
    return most


def pack(sched_out, bucket: tuple[int, int], tile: int, num_segments: int) -> PoolingRows | None:
    """The rows of a step whose hidden states a pooling request asks for; None when there are
    none (the usual step)."""
    segments = None
    reads = []
    for req, start in request_rows(sched_out, bucket, tile):
        pooling = getattr(req.sampling, "pooling", None)
        if pooling is None or req.num_draft_tokens:
            continue
        n = len(req.token_ids)
        c0 = req.num_computed_tokens
        if pooling == "last":
            if not req.sample:       # the prompt's last token is in the chunk that samples
                continue
            start, first, n = start + n - 1, c0 + n - 1, 1
        else:
            first = c0
        if segments is None:
            segments = np.full(step_rows(bucket, tile), num_segments, np.int32)
        slot = len(reads)
        segments[start:start + n] = slot
        reads.append((req.request_id, first, n, slot))
    if segments is None:
        return None
    return PoolingRows(step_rows(bucket, tile), segments, tuple(reads))


class Pooling(StepFeature):
    """The runner's part: one compiled `pooled_sums` per step row count, run on a step's hidden
    states when its PoolingRows say so, read back at collect."""

    name = "pooling"
    step_outputs = frozenset({"hidden"})

    def __init__(self):
        if jax.process_count() > 1:
            # its start-up runs are not mirrored to the other hosts as the steps' are
            raise ValueError("enable_embeddings is not built for an engine on several hosts")

    def attach(self, runner) -> None:
        super().attach(runner)
        self.tile = runner.shapes.prefill_tile
        self.num_segments = max_segments(runner.shapes.buckets(), self.tile)
        self._compiled = ExecutableStore(sorted(self.num_segments), self._build, "pooling")

    def _lower(self, rows: int):
        r = self.runner
        fn = functools.partial(pooled_sums, num_segments=self.num_segments[rows])
        hidden = r.programs.input_spec((rows, r.model_config.hidden_size), hidden_dtype(r.steps))
        segments = r.programs.input_spec((rows,), jnp.int32)
        return r.programs.jit(fn).lower(hidden, segments)

    def _build(self, rows: int):
        return self.runner.programs.load_or_compile(
            {"kind": "pooling", "rows": rows, "segments": self.num_segments[rows]}, lambda: self._lower(rows))

    def load(self, buckets) -> float:
        """Load (or compile) the functions of these buckets' row counts and run each once (an
        XLA:CPU executable's first run is slow: runner/warmup.py). Returns the seconds spent."""
        t0 = time.perf_counter()
        counts = sorted({step_rows(b, self.tile) for b in buckets})
        self._compiled.load(counts)
        r = self.runner
        dtype = hidden_dtype(r.steps)
        for rows in counts:
            hidden = r.programs.place(np.zeros((rows, r.model_config.hidden_size), dtype))
            segments = r.programs.place(np.zeros(rows, np.int32))
            jax.block_until_ready(self._compiled[rows](hidden, segments))
        return time.perf_counter() - t0

    def loaded_on_demand(self) -> list:
        return self._compiled.loaded_on_demand

    def pack(self, sched_out, bucket: tuple[int, int] | None) -> PoolingRows | None:
        if bucket is None:
            return None
        rows = step_rows(bucket, self.tile)
        return pack(sched_out, bucket, self.tile, self.num_segments[rows])

    def run(self, outputs, rows: PoolingRows):
        """Dispatch the step's pooling; the sums' copy to the host starts at once."""
        out = self._compiled[rows.rows](outputs["hidden"], self.runner.programs.place(rows.segments))
        out.copy_to_host_async()
        return rows, out

    def read(self, dispatched) -> dict[str, PooledChunk]:
        """Wait for a step's sums: request id -> the positions its rows covered, summed."""
        rows, out = dispatched
        sums = np.asarray(out)
        return {rid: PooledChunk(first, count, sums[slot]) for rid, first, count, slot in rows.reads}
