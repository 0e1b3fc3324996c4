"""warm_up="background": ready on the plan's first buckets, the rest warmed beside serving.

The builder warms the plan's first buckets (runner/warm_plan.py) before it returns the engine,
holds the runner to them and the scheduler to the step cap they allow, and starts the thread that
warms the rest (runner/background_warmup.py); each bucket it warms widens both, the last removes
them.
A bucket's programs are its step, its sampler and every step feature's program for it (prompt
logprobs, pooling: runner.load_executables), so a request that asks for one never steps in a
bucket whose feature program is cold: it runs in warm ones. LoRA slot writes wait for
the thread's run in progress (lora/slot_writes.py). The grammar compiler's tokenizer and the LoRA
slot writer are built by the thread before the buckets (its helpers); a request that needs one
before then builds it itself and waits for it, never failing.
What the cap cannot bound falls back to warm_up="all" (everything warm before the engine
returns), with the reason logged:
- speculative decoding: a verification's guesses are extra decode rows beyond the seats;
- several hosts: the followers mirror every program the leader runs, and the thread's runs are
  not steps they could mirror;
- a prefill or decode role: the KV connector admits requests by max_num_seqs itself.
"""

from __future__ import annotations

import logging

from jaxserve.config import EngineConfig
from jaxserve.runner.background_warmup import BackgroundWarmUp
from jaxserve.runner.warm_plan import BucketReadiness, WarmPlan, warm_plan

log = logging.getLogger(__name__)


def background_refusal(config: EngineConfig, multi_host: bool) -> str | None:
    """Why this engine cannot warm in the background (None: it can)."""
    if config.speculative_config is not None:
        return "speculative decoding (its guesses are decode rows beyond the seats a cap bounds)"
    if multi_host:
        return "several hosts (the followers mirror only the steps the leader runs)"
    if config.disagg.role != "both":
        return f"role={config.disagg.role!r} (the KV connector admits requests by max_num_seqs)"
    if config.scheduler.max_num_batched_tokens < config.compilation.prefill_tile:
        return "a token budget under one prefill tile"
    return None


BACKGROUND_MODES = ("background", "serving")


def plan(config: EngineConfig, runner) -> WarmPlan:
    """The warm-up plan; warm_up="serving" warms every bucket but the padding-only ones first."""
    p = warm_plan(runner.shapes, max_num_seqs=config.scheduler.max_num_seqs,
                  max_num_batched_tokens=config.scheduler.max_num_batched_tokens)
    return p.serving_first() if config.compilation.warm_up == "serving" else p


def prepare(scheduler, runner, plan: WarmPlan) -> BackgroundWarmUp:
    """Hold the runner to the first set's buckets (which the caller warmed) and the scheduler to
    the cap they hold, and make the thread that warms the rest (not started: the engine built on
    them keeps it as `engine.background_warm_up`, and the builder starts it once the engine
    exists). Each bucket it warms widens the runner's choice; the cap follows."""
    last_cap = []

    def on_change(warm, cap) -> None:
        runner.restrict_buckets(warm)      # first: the cap never admits a step no warm bucket holds
        scheduler.cap_steps(cap)
        if not last_cap or cap != last_cap[-1]:
            last_cap[:] = [cap]
            log.info("warm-up: %s", readiness.describe())

    readiness = BucketReadiness(plan, runner.shapes)
    readiness.mark_ready(plan.first)
    runner.restrict_buckets(readiness.warm)
    scheduler.cap_steps(readiness.cap)
    last_cap.append(readiness.cap)
    readiness.on_change = on_change
    log.info("warm-up: %s; the other buckets warm in the background", readiness.describe())
    return BackgroundWarmUp(runner, readiness, busy=scheduler.has_unfinished_requests)
