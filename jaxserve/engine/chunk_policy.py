"""The default prefill chunk size, derived from an inter-token-latency budget at start-up.

While a long prompt prefills, every decoding request waits for the step that carries its chunk.
If that step may take `itl_budget` longer than a decode-only step, the chunk may hold
itl_budget x prefill tokens/s tokens (jaxserve.sched.chunking.max_chunk_for_itl). The budget
defaults to the measured decode-only step time of the decode batch beside the chunk, so a long
prompt at most doubles the decoders' inter-token latency: one budget per compiled decode bucket
of mixed steps (1, 4, 16, 32 decodes by default), each its decode-only step time, since a step
of 16 decodes takes about 60% of one of 32 and the same ratio then allows a smaller chunk.
The prefill rate is the marginal one that matters here: prompt tokens per second a one-tile
chunk adds to a full decode batch, with the chunk at the deepest position a prompt reaches
(max_model_len less the chunk). A chunk's attention reads its whole context, so the deepest
chunk is the costliest, and the bound is to hold for every chunk, the p99 of the decoders'
latency rather than its mean (a rate taken halfway in let the last quarter of a long prompt
overshoot the budget; a prefill from an empty context overstates the rate several times).
The chunk is never smaller than one prefill tile: where even one tile at the deepest position
costs more than the budget (a long max_model_len on a slow machine), that tile is the floor,
and `prefill_tile` is the knob that lowers it. Both measurements run once, on scratch blocks,
before the engine takes requests, or come from an earlier start's (runner/calibration.py).
The derived chunks cap prompts only in steps that carry decodes (the scheduler's
`decode_step_prefill_cap` and `decode_step_prefill_caps`): with nobody decoding there is no
latency to protect, and a prompt takes the whole token budget. An explicit `long_prefill_token_threshold` (0 = no cap) skips all
of this and caps every step, as in vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.sched.chunking import max_chunk_for_itl

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    chunk_tokens: int                       # most prompt tokens of one request per step (0: no cap)
    derived: bool                           # True: measured at start-up, applied only beside decodes
    itl_budget_s: float | None = None       # the full decode batch's budget
    prefill_tokens_per_s: float | None = None
    # derived only: (at most this many decodes, chunk) for smaller decode batches, whose cheaper
    # decode-only step leaves a smaller budget; chunk_tokens covers the full batch
    by_decodes: tuple[tuple[int, int], ...] = ()


def resolve_chunk_policy(config: EngineConfig, calibrator) -> ChunkPolicy:
    """`calibrator`: a runner.calibration.Calibrator (anything with its measure_* methods and shapes)."""
    if config.long_prefill_token_threshold is not None:
        return ChunkPolicy(config.long_prefill_token_threshold, derived=False)
    if not config.enable_chunked_prefill:
        return ChunkPolicy(0, derived=False)
    tokens_per_s = calibrator.measure_chunk_rate()
    tile = config.prefill_tile

    def chunk_for(budget_s: float) -> int:
        return max_chunk_for_itl(budget_s, tokens_per_s, multiple=tile, minimum=tile)

    if config.itl_budget_ms:
        budget = config.itl_budget_ms / 1e3
        by_decodes: tuple[tuple[int, int], ...] = ()
    else:
        # one budget per decode bucket of the steps that carry chunks: the decode-only step time
        # of that many decodes (measured, like the rate, on scratch blocks)
        rows = calibrator.shapes.decode_buckets
        budgets = [calibrator.measure_decode_step_time(rows=r) for r in rows]
        budget = budgets[-1]
        by_decodes = tuple((r, chunk_for(b)) for r, b in zip(rows[:-1], budgets[:-1]))
    chunk = chunk_for(budget)
    policy = ChunkPolicy(chunk, derived=True, itl_budget_s=budget, prefill_tokens_per_s=tokens_per_s,
                         by_decodes=by_decodes)
    log.info("prefill chunk: %d tokens = ITL budget %.0f ms x %.0f prefill tokens/s (rounded down to %d-token tiles); "
             "smaller decode batches (decodes, chunk): %s", chunk, budget * 1e3, tokens_per_s, tile, by_decodes)
    return policy
