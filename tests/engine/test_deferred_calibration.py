"""A server warming in the background on a cold calibration cache (`jaxserve serve`'s first start)
turns ready without measuring: it serves with the provisional chunk policy, and the engine
measures once it is idle and every bucket is warm, with the prefix cache emptied first (the
measurements write the arena's blocks 1, 2, ...), then serves with the measured policy. The next
start finds the timings in its cache and measures nothing."""

import asyncio
import os
import time

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from tests.conftest import TINY_ENGINE

GUARD_S = 600   # a warm-up that never ends fails the test instead of hanging it
# the serving default (chunk_policy "slo", derived from timings) rather than the tests' fixed cap
ENGINE = {**TINY_ENGINE, "long_prefill_token_threshold": None, "warm_up": "background"}
PROMPT = {"prompt_token_ids": list(range(3, 40))}     # 37 tokens: full blocks the prefix cache keeps
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _warm(engine) -> None:
    assert engine.background_warm_up.join(GUARD_S), "the background warm-up did not finish"


def test_a_cold_start_defers_calibration_until_idle_and_then_serves_the_measured_policy(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, **{**ENGINE, "cache_dir": str(tmp_path)})
    engine, scheduler = llm.engine, llm.engine.scheduler
    assert engine.deferred_calibration is not None and engine.idle_work_pending
    assert engine.chunk_policy.provisional and "provisional" in engine.chunk_policy.describe()
    assert scheduler.config.objectives is None and scheduler.config.long_prefill_token_threshold == 0
    assert engine.calibration.swap_cost is None            # recompute until the swap cost is measured

    before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert scheduler.kv.pool.num_cached > 0                # the prompt's full blocks stay cached
    _warm(engine)
    assert engine.run_idle_work()
    assert not engine.idle_work_pending and not engine.run_idle_work()   # once
    policy = engine.chunk_policy
    assert not policy.provisional and policy.objectives is not None and policy.step_cost is not None
    assert scheduler.config.objectives is policy.objectives and scheduler.config.step_cost is policy.step_cost
    assert scheduler.preemption.config is scheduler.config and scheduler.admission.config is scheduler.config
    assert engine.calibration.swap_cost is not None
    assert scheduler.kv.pool.num_cached == 0               # emptied: calibration wrote those blocks
    # the same prompt again computes its KV afresh: the same tokens (a cache that kept blocks the
    # calibration overwrote would serve other K/V)
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before
    assert scheduler.kv.pool.num_in_use == 0
    assert llm.stats().steps.num_compilations_after_warmup == 0   # it ran warm buckets and helpers only
    assert os.listdir(tmp_path / "calibration")

    again = LLM(tiny_llama_dir, **{**ENGINE, "cache_dir": str(tmp_path)})   # a warm start: all cached
    assert again.engine.deferred_calibration is None and not again.engine.chunk_policy.provisional
    assert again.engine.chunk_policy.objectives == policy.objectives
    _warm(again.engine)


def test_the_async_engine_runs_it_when_idle_and_not_while_a_request_runs(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **ENGINE)      # cache_dir="": nothing cached, always deferred
    engine = llm.engine
    ran_with_live_requests = []
    run = engine.deferred_calibration.run

    def recording():
        ran_with_live_requests.append(engine.scheduler.has_unfinished_requests())
        return run()

    engine.deferred_calibration.run = recording

    async def main():
        aengine = AsyncEngine(engine)
        try:
            tokens = []
            async for out in aengine.generate(PROMPT, GREEDY, request_id="a"):
                tokens = out.outputs[0].token_ids
            deadline = time.monotonic() + GUARD_S
            while engine.idle_work_pending:        # the idle step thread gets to it
                assert time.monotonic() < deadline, "the idle engine never calibrated"
                await asyncio.sleep(0.05)
            async for out in aengine.generate(PROMPT, GREEDY, request_id="b"):
                after = out.outputs[0].token_ids
            return tokens, after
        finally:
            await aengine.shutdown()

    tokens, after = asyncio.run(main())
    assert ran_with_live_requests == [False]
    assert not engine.chunk_policy.provisional and engine.chunk_policy.objectives is not None
    assert len(tokens) == 12 and after == tokens


class _Fake:
    """What DeferredCalibration.run_if_idle reads of an engine; `retuned` records the knobs it set."""

    def __init__(self, *, live=False, warming_failed=(), reset_ok=True):
        import types

        self.paused = self.asleep = False
        self.retuned = []
        self.background_warm_up = types.SimpleNamespace(running=False, failed=list(warming_failed))
        self.scheduler = types.SimpleNamespace(has_unfinished_requests=lambda: live,
                                               reset_prefix_cache=lambda: reset_ok,
                                               retune=lambda **k: self.retuned.append(k))


def test_it_waits_for_an_idle_engine_and_gives_up_on_a_failed_warm_up():
    from jaxserve.engine.chunk_policy import ChunkPolicy
    from jaxserve.engine.deferred_calibration import DeferredCalibration
    from jaxserve.engine.startup_calibration import StartupCalibration

    measured = StartupCalibration(ChunkPolicy(64, derived=True))
    runs = []

    def deferred():
        return DeferredCalibration(lambda: runs.append(1) or measured)

    busy, d = _Fake(live=True), deferred()
    assert d.run_if_idle(busy) is None and d.pending and not runs
    held, d = _Fake(reset_ok=False), deferred()     # blocks still held: the cache cannot be emptied yet
    assert d.run_if_idle(held) is None and d.pending and not runs
    failed, d = _Fake(warming_failed=[((4, 0), "boom")]), deferred()   # measuring would compile on the step thread
    assert d.run_if_idle(failed) is None and not d.pending and not runs and not failed.retuned
    idle, d = _Fake(), deferred()
    assert d.run_if_idle(idle) is measured and not d.pending and runs == [1]
    assert idle.retuned == [measured.scheduler_knobs()] and idle.retuned[0]["decode_step_prefill_cap"] == 64
    assert d.run_if_idle(idle) is None and runs == [1]      # once
