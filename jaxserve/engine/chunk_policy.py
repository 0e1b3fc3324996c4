"""How prompts are cut into chunks: the one place the prefill policy is chosen.

Three policies, by EngineConfig:

- `long_prefill_token_threshold=N` (LLM's default, and any explicit setting): at most N prompt
  tokens of one request per step, every step (0 = no cap), as in vLLM.
- `chunk_policy="slo"` (the serving default): chunks sized to service objectives, a time to
  first token and a time per output token (`ttft_slo_ms`, `tpot_slo_ms`; defaults derived from
  this machine's timings, below). The scheduler predicts each candidate step's time with a
  step-cost model measured at start-up (sched/step_cost.py) and fills a step that carries decodes
  with prompt tokens, of as many prompts as fit, up to a time allowance (sched/step_budget.py):
  0.9 x the TPOT objective, or more when a prompt's TTFT is at risk and every decoder in the step
  has banked the time. A step with nobody decoding takes the whole token budget.
  Defaults, "interactive chat on this machine": TPOT max(100 ms, 1.5 x a decode step of the full
  mixed-step decode bucket), so a full server still decodes within it with room for a chunk beside;
  TTFT max(1 s, 2 x a step of a full token budget of prompt), so a prompt of one full budget is
  answered within two such steps' time (a prompt is at risk, and may be given more than the floor,
  soon enough for that).
- `chunk_policy="itl"` (the earlier default, kept to compare against): one fixed chunk per decode
  bucket from an inter-token-latency budget, below.

The itl policy. While a long prompt prefills, every decoding request waits for the step that
carries its chunk.
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
and `prefill_tile` is the knob that lowers it. The derived chunks cap prompts only in steps that
carry decodes (the scheduler's `decode_step_prefill_cap` and `decode_step_prefill_caps`). Its
measured weakness (docs/benchmarks-history.md, "Goodput"): on a slow machine with a long max_model_len the
deepest chunk's rate is tiny (8 tokens a step on our CPU), and with one prompt mid-prefill at a
time prompts starve behind any decode.

Every measurement runs once, on scratch blocks, before the engine takes requests (a server warming
in the background: once it is idle, engine/deferred_calibration.py, with PROVISIONAL
until then), or comes from an earlier start's (runner/calibration.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.sched.chunking import max_chunk_for_itl
from jaxserve.sched.step_budget import ServiceObjectives
from jaxserve.sched.step_cost import StepCostModel

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
    # chunk_policy="slo": the objectives and the model that sizes chunks to them (chunk_tokens 0)
    objectives: ServiceObjectives | None = None
    step_cost: StepCostModel | None = None
    # the policy of a server that turned ready before its timings were measured (PROVISIONAL)
    provisional: bool = False

    def describe(self) -> str:
        if self.provisional:
            return "provisional until this machine's timings are measured: no cap per request per step"
        if self.objectives is not None:
            return (f"slo: TTFT {self.objectives.ttft_s * 1e3:.0f} ms, TPOT {self.objectives.tpot_s * 1e3:.0f} ms "
                    f"(steps with decodes within {self.objectives.floor_s * 1e3:.0f} ms unless a prompt's TTFT "
                    f"is at risk)")
        if self.derived:
            return f"itl: {self.chunk_tokens}-token chunks beside decodes (by decode bucket {self.by_decodes})"
        return f"fixed: {self.chunk_tokens or 'no'} token cap per request per step"


# A server whose calibration is not cached turns ready without it (engine/builder.py) and takes
# prompts as vLLM's default does until the engine, idle, has measured: whole prompt-token budgets,
# no chunk cap (chunked prefill still splits a prompt longer than the step's budget).
PROVISIONAL = ChunkPolicy(0, derived=False, provisional=True)
NO_CHUNK_CAP = ChunkPolicy(0, derived=False)


def resolve_chunk_policy(config: EngineConfig, calibrator) -> ChunkPolicy:
    """`calibrator`: a runner.calibration.Calibrator (anything with its measure_* methods and shapes)."""
    if config.chunking.long_prefill_token_threshold is not None:
        return ChunkPolicy(config.chunking.long_prefill_token_threshold, derived=False)
    if not config.scheduler.enable_chunked_prefill:
        return ChunkPolicy(0, derived=False)
    if config.chunking.chunk_policy == "slo":
        return _slo_policy(config, calibrator)
    tokens_per_s = calibrator.measure_chunk_rate()
    tile = config.compilation.prefill_tile

    def chunk_for(budget_s: float) -> int:
        return max_chunk_for_itl(budget_s, tokens_per_s, multiple=tile, minimum=tile)

    if config.chunking.itl_budget_ms:
        budget = config.chunking.itl_budget_ms / 1e3
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


# the context depth the per-item attention cost is measured at (a one-tile chunk there against the
# same tile at depth 0): deep enough for many items, as deep as chat prompts go
ITEM_COST_DEPTH = 2048
ITEM_TOKENS = 64          # context tokens per attention item: the XLA kernel's default kv chunk (4 blocks of 16)
DECODE_CONTEXT = 256      # the decode rows' context in the decode-step timings


def measure_step_cost(calibrator) -> StepCostModel:
    """The step-cost model of sched/step_cost.py from this runner's timings."""
    shapes = calibrator.shapes
    tile = shapes.prefill_tile
    decode_s = tuple((r, calibrator.measure_decode_step_time(context=DECODE_CONTEXT, rows=r))
                     for r in shapes.decode_buckets)
    prefill_s = tuple((p, calibrator.measure_prefill_step_time(p)) for p in shapes.prefill_buckets if p > 0)
    item_tokens = ITEM_TOKENS
    # as deep as the engine's requests go (a short max_model_len, a small arena), at most ITEM_COST_DEPTH
    depth = calibrator.prefill_depth(1, ITEM_COST_DEPTH)
    deep = calibrator.measure_prefill_step_time(1, depth=depth)
    probe = StepCostModel(decode_s, prefill_s, 0.0, tile, item_tokens, DECODE_CONTEXT)
    _, items = probe.chunk_items(depth, tile)
    item_s = max(0.0, deep - prefill_s[0][1]) / items if items else 0.0
    return StepCostModel(decode_s, prefill_s, item_s, tile, item_tokens, DECODE_CONTEXT)


def default_objectives(config: EngineConfig, cost: StepCostModel, max_num_batched_tokens: int) -> ServiceObjectives:
    """The operator's objectives, or the module doc's defaults for those not given."""
    tpot = (config.chunking.tpot_slo_ms / 1e3 if config.chunking.tpot_slo_ms
            else max(0.1, 1.5 * cost.decode_s[-1][1]))
    if config.chunking.ttft_slo_ms:
        ttft = config.chunking.ttft_slo_ms / 1e3
    else:
        tokens = min(max_num_batched_tokens, cost.max_tiles * cost.tile)
        full_step = cost.decode_s[0][1] + cost.prefill_seconds(*cost.chunk_items(0, tokens))
        ttft = max(1.0, 2 * full_step)
    return ServiceObjectives(ttft_s=ttft, tpot_s=tpot)


def _slo_policy(config: EngineConfig, calibrator) -> ChunkPolicy:
    cost = measure_step_cost(calibrator)
    objectives = default_objectives(config, cost, config.scheduler.max_num_batched_tokens)
    policy = ChunkPolicy(0, derived=False, objectives=objectives, step_cost=cost)
    log.info("prefill chunks: %s; step-cost model: decode %s, prefill tiles %s, %.2f ms per %d-token item",
             policy.describe(), [(r, round(s * 1e3, 1)) for r, s in cost.decode_s],
             [(p, round(s * 1e3, 1)) for p, s in cost.prefill_s], cost.item_s * 1e3, cost.item_tokens)
    return policy
