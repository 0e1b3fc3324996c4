"""What start-up measured for one engine (engine/builder.py `_calibrate`): the prefill chunk
policy, the swap cost model behind preemption_mode="auto", and the decode-only step times that
adaptive speculation weighs its guesses against. A value: the builder turns it into the
scheduler's derived knobs, and a cold server's deferred calibration (deferred_calibration.py)
hands a new one to the engine once it has measured."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.engine.chunk_policy import ChunkPolicy
from jaxserve.runner.host_swap import SwapCostModel

# swap_crossover_tokens with no swap cost model: never swap in auto mode (recompute)
NEVER_SWAP = 1 << 30


@dataclass(frozen=True, slots=True)
class StartupCalibration:
    chunk_policy: ChunkPolicy
    swap_cost: SwapCostModel | None = None       # None: no host pool, or not measured yet (recompute)
    # (decode-only bucket, seconds): what speculation's extra rows cost; () unless it is adaptive
    decode_step_seconds: tuple[tuple[int, float], ...] = ()

    def scheduler_knobs(self) -> dict:
        """The SchedulerConfig fields the chunk policy and the swap cost model set (those a
        Scheduler.retune may replace)."""
        chunking = self.chunk_policy
        crossover = self.swap_cost.crossover_tokens() if self.swap_cost is not None else NEVER_SWAP
        return dict(
            long_prefill_token_threshold=0 if chunking.derived else chunking.chunk_tokens,
            decode_step_prefill_cap=chunking.chunk_tokens if chunking.derived else 0,
            decode_step_prefill_caps=chunking.by_decodes,
            objectives=chunking.objectives,
            step_cost=chunking.step_cost,
            swap_crossover_tokens=min(crossover, NEVER_SWAP),
        )
