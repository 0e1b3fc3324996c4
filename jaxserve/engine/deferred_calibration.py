"""A cold server's start-up calibration, measured once the engine is idle instead of before ready.

A server warming in the background (warm_up="background", `jaxserve serve`'s default) whose
calibration cache lacks a timing turns ready with the provisional chunk policy
(engine/chunk_policy.py PROVISIONAL) and keeps a `DeferredCalibration` on the engine
(engine/builder.py). `Engine.run_idle_work` runs it on the step thread (the async engine's,
polling while idle; a synchronous caller calls it itself) once:
- no request is live or held, and the engine is neither paused nor asleep;
- the background warm-up has ended with every bucket warm (a bucket it failed would compile on
  the step thread: then the provisional policy stays, logged);
- the prefix cache is emptied: the measurements write the arena's blocks 1, 2, ..., which with
  nothing running only the cache can hold (a KV hand-off's held blocks: later).
Then the measured chunk policy and swap crossover replace the provisional ones
(`Scheduler.retune`; the engine keeps the new StartupCalibration) and the timings go to the
cache for the next start. A request that arrives meanwhile waits for it: seconds, once per
cold start (13.7 s on our CPU, docs/benchmarks.md).
A failure while measuring propagates, as it would have at start-up.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


class DeferredCalibration:
    """calibrate(): measure (what the cache lacks) and return the engine's StartupCalibration
    (engine/startup_calibration.py). Runs once: `pending` is False after it ran or was given up."""

    def __init__(self, calibrate: Callable):
        self._calibrate = calibrate
        self.pending = True

    def run(self):
        return self._calibrate()

    def run_if_idle(self, engine):
        """Run if the module doc's conditions hold (the engine has checked that no request is held
        and no step is in flight): the new StartupCalibration, the scheduler retuned to it, or
        None (not run now, or given up: then `pending` is False)."""
        if not self.pending or engine.paused or engine.asleep or engine.scheduler.has_unfinished_requests():
            return None
        warming = engine.background_warm_up
        if warming is not None:
            if warming.running:
                return None
            if warming.failed:
                self.pending = False
                log.warning("calibration stays provisional: the background warm-up left buckets unready %s",
                            [b for b, _ in warming.failed])
                return None
        if not engine.scheduler.reset_prefix_cache():
            return None
        self.pending = False      # once, whatever happens below
        calibration = self.run()
        engine.scheduler.retune(**calibration.scheduler_knobs())
        log.info("calibrated while idle: prefill chunks %s", calibration.chunk_policy.describe())
        return calibration
