"""A cold server's start-up calibration, measured once the engine is idle instead of before ready.

A server warming in the background (warm_up="background", `jaxserve serve`'s default) whose
calibration cache lacks a timing turns ready with the provisional chunk policy
(engine/chunk_policy.py PROVISIONAL) and keeps a `DeferredCalibration` on the engine
(engine/builder.py). `run_if_idle` runs it on the step thread (the async engine's, polling while
idle; a synchronous caller calls `Engine.run_idle_work` itself) once:
- no request is live or held, and the engine is neither paused nor asleep;
- the background warm-up has ended with every bucket warm (a bucket it failed would compile on
  the step thread: then the provisional policy stays, logged);
- the prefix cache is emptied: the measurements write the arena's blocks 1, 2, ..., which with
  nothing running only the cache can hold (a KV hand-off's held blocks: later).
Then the measured chunk policy and swap crossover replace the provisional ones
(`Scheduler.retune`) and the timings go to the cache for the next start. A request that arrives
meanwhile waits for it: seconds, once per cold start (13.7 s on our CPU, docs/benchmarks.md).
A failure while measuring propagates, as it would have at start-up.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


class DeferredCalibration:
    """calibrate(): measure (what the cache lacks) and return the chunk policy; knobs(policy): the
    SchedulerConfig fields that policy and the runner's swap cost model set."""

    def __init__(self, calibrate: Callable, knobs: Callable):
        self._calibrate, self._knobs = calibrate, knobs

    def run(self):
        policy = self._calibrate()
        return policy, self._knobs(policy)


def run_if_idle(engine) -> bool:
    """Run the engine's deferred calibration if the module doc's conditions hold (the engine has
    checked that no request is held and no step is in flight); returns whether it ran (or was
    given up for good)."""
    deferred = engine.deferred_calibration
    if deferred is None or engine.paused or engine.asleep or engine.scheduler.has_unfinished_requests():
        return False
    warming = engine.background_warm_up
    if warming is not None:
        if warming.running:
            return False
        if warming.failed:
            engine.deferred_calibration = None
            log.warning("calibration stays provisional: the background warm-up left buckets unready %s",
                        [b for b, _ in warming.failed])
            return True
    if not engine.scheduler.reset_prefix_cache():
        return False
    engine.deferred_calibration = None      # once, whatever happens below
    policy, knobs = deferred.run()
    engine.scheduler.retune(**knobs)
    engine.chunk_policy = policy
    log.info("calibrated while idle: prefill chunks %s", policy.describe())
    return True
