"""How long a step that carries decodes may take: the service objectives turned into a time budget.

The operator states what a request must see (`ServiceObjectives`: a time to first token and a
time per output token); a request that meets both counts toward goodput. Every step that carries
decodes delays each of them by its whole duration, and every prompt chunk it carries lengthens it,
so the scheduler sizes the step's prompt chunks to a time allowance (step_cost.StepCostModel
predicts the time of a candidate step):

- The floor: `tpot_s x step_share`. A step within it keeps every decoder within its TPOT objective
  by itself, with room for the model's error, so a stream's inter-token latency stays under the
  objective however many prompts arrive.
- More when a prompt's TTFT is at risk and can still be saved: its first token is due at arrival +
  ttft_s, the prompt tokens ahead of it in the step order (its own included) would take longer
  than that at the floor's pace, and not longer at a full budget's pace. Then the step may take
  what the decoders can spare: TPOT is a mean over a request's tokens, so a decoder that has run
  ahead of its objective has banked time (`slack_share x tpot_s x tokens since its first token
  - the time since`). The allowance is the smallest bank among the step's decoders, so no decoder
  is pushed past its objective. A prompt that cannot be saved any more gets the floor's share
  only: spending others' time on a lost cause lowers goodput.

With no decode in the step there is no one to delay and prompts take the whole token budget.

The model's times come from start-up; the machine may run slower or faster now (other load, or a
calibration taken under load and kept). The scheduler learns the ratio of measured to predicted
step time from the steps the engine reports (Scheduler.observe_step_time) and compares the model's
predictions, so scaled, with the allowance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from jaxserve.sched.request import Request
from jaxserve.sched.step_cost import StepCostModel


@dataclass(frozen=True, slots=True)
class ServiceObjectives:
    ttft_s: float            # time to first token a request should see
    tpot_s: float            # mean time per output token after the first
    step_share: float = 0.9  # the floor's share of tpot_s (room for the step-time model's error)
    # share of tpot_s x tokens a decoder's bank is counted against. Above step_share, so a decoder
    # whose steps run at the floor banks time: at 0.8 (the earlier default) none did, an at-risk
    # prompt never got more than the floor, and under sustained load (8 streams on the 2-core CPU)
    # half the seats waited on prompts prefilling a tile a step; 0.95 there: 1.2x the tokens/s,
    # TTFT p50 6.9 -> 2.8 s, every request's TPOT still within the objective (docs/benchmarks.md,
    # "8 streams on the AVX2 EPYC")
    slack_share: float = 0.95

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("step_share", "slack_share"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")

    @property
    def floor_s(self) -> float:
        return self.tpot_s * self.step_share


def decoder_bank_s(req: Request, slo: ServiceObjectives, now: float) -> float:
    """Seconds a decoder can wait for its next token and still end within its TPOT objective, if
    every later token comes within the floor. Its first token not seen yet: nothing banked."""
    if req.first_token_time is None:
        return slo.floor_s
    tokens = req.num_outputs_with_pending           # its intervals once this step's token is out
    return slo.slack_share * slo.tpot_s * tokens - (now - req.first_token_time)


def step_allowance(cost: StepCostModel, slo: ServiceObjectives, now: float, decodes: Sequence[Request],
                   decode_seconds: float, prompts: Sequence[Request], budget_tokens: int,
                   scale: float = 1.0) -> float:
    """Seconds the step may take (see the module doc). `decodes`: the step's decoders;
    `decode_seconds`: what they cost alone (the model's seconds); `prompts`: requests with prompt
    tokens to compute, in the order the scheduler serves them; `budget_tokens`: the step's token
    budget for prompts; `scale`: real seconds per model second, as measured lately."""
    floor = slo.floor_s
    if not decodes or not _a_prompt_to_save(cost, slo, now, decode_seconds, prompts, budget_tokens, scale):
        return floor
    bank = min(decoder_bank_s(r, slo, now) for r in decodes)
    return max(floor, bank)


def _a_prompt_to_save(cost: StepCostModel, slo: ServiceObjectives, now: float, decode_seconds: float,
                      prompts: Sequence[Request], budget_tokens: int, scale: float) -> bool:
    # in the model's seconds: the floor and the time left are divided by the scale
    floor_rate = _tokens_per_s(cost, decode_seconds, slo.floor_s / scale, cost.tile)
    full_tokens = max(cost.tile, min(budget_tokens, cost.max_tiles * cost.tile) // cost.tile * cost.tile)
    ahead = 0
    for req in prompts:
        ahead += req.num_tokens - req.num_computed_tokens
        left = (req.arrival_time + slo.ttft_s - now) / scale
        if ahead / floor_rate > left and _full_budget_seconds(cost, decode_seconds, ahead, full_tokens) <= left:
            return True
    return False


def _full_budget_seconds(cost: StepCostModel, decode_seconds: float, tokens: int, full_tokens: int) -> float:
    """Time to compute `tokens` prompt tokens (from depth 0) in steps of `full_tokens` beside the decodes."""
    steps, rest = divmod(tokens, full_tokens)
    t = steps * (decode_seconds + cost.prefill_seconds(*cost.chunk_items(0, full_tokens)))
    if rest:
        t += decode_seconds + cost.prefill_seconds(*cost.chunk_items(0, rest))
    return t


def _tokens_per_s(cost: StepCostModel, decode_seconds: float, step_s: float, tile: int) -> float:
    """Prompt tokens per second that steps of `step_s` carry beside the decodes (at least a tile a step)."""
    room = step_s - decode_seconds
    n = tile
    while n + tile <= cost.max_tiles * tile and cost.prefill_seconds(*cost.chunk_items(0, n + tile)) <= room:
        n += tile
    return n / max(step_s, decode_seconds + cost.prefill_seconds(*cost.chunk_items(0, n)))


def chunk_within(cost: StepCostModel, num_computed: int, n: int, decode_s: float, tiles: int, items: int,
                 allowance_s: float) -> int:
    """The most of a prompt's n next tokens (after num_computed) that a step already holding
    decodes of `decode_s` and `tiles` prefill tiles with `items` extra attention items can add
    within `allowance_s` (model seconds): all n, or whole tiles; one tile when the step has no
    prompt tile yet (every step moves some prompt forward), else possibly 0."""
    def fits(k: int) -> bool:
        t, i = cost.chunk_items(num_computed, k)
        if tiles + t > cost.max_tiles:
            return False
        return decode_s + cost.prefill_seconds(tiles + t, items + i) <= allowance_s

    tile = cost.tile
    if fits(n):
        return n
    lo, hi = 0, (n - 1) // tile  # in whole tiles: 0 fits, hi + 1 tiles would be n or more
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * tile):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0 and tiles == 0:
        return min(n, tile)
    return lo * tile


class StepTimeScale:
    """How the machine runs steps now against the start-up model (a calibration taken under other
    load, other processes now): an exponential average of measured / predicted over steps with
    decodes and prompt tiles, which the time allowance divides by."""

    WEIGHT = 0.2             # each measured step's weight
    BOUNDS = (0.25, 4.0)     # one step's ratio is clipped to these (a stall, a GC pause)

    def __init__(self) -> None:
        self.value = 1.0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        if not (predicted_s > 0 and measured_s > 0):
            return
        ratio = min(max(measured_s / predicted_s, self.BOUNDS[0]), self.BOUNDS[1])
        self.value += self.WEIGHT * (ratio - self.value)
