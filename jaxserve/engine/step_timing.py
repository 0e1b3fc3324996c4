"""How much of the engine's time the host spends per step, and how long the device sits idle.

`host_ms_per_step`: wall time inside `Engine.step` not spent waiting for the device, per step:
scheduling, packing, dispatching, detokenizing, building outputs. `device_idle_fraction`: the
share of the engine's busy wall time (from a step call while it has work to the end of the step
call that leaves it without work) with no step in flight. A step is in flight from its dispatch
(or the end of the step before it, the device runs them in order) until its sampled tokens are on
the host; when they were ready before the host asked, the host cannot know exactly when, and
counts up to the moment it asked: the idle fraction is a lower bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class StepTimingStats:
    steps: int
    host_ms_per_step: float
    device_idle_fraction: float


class StepTimer:
    def __init__(self) -> None:
        self.steps = 0
        self._host_s = 0.0
        self._busy_wall_s = 0.0         # engine wall time while it had work
        self._in_flight_s = 0.0         # of that, time with a step in flight
        self._period_start: float | None = None
        self._device_free_at = 0.0      # when the last collected step finished (as far as known)
        self._call_start = 0.0
        self._waited = 0.0
        self.recent_host_s = 0.0        # host time of a step call outside waiting, a running average

    # ---- around one Engine.step call ----
    def step_started(self) -> None:
        now = time.perf_counter()
        self._call_start = now
        self._waited = 0.0
        if self._period_start is None:
            self._period_start = now

    def step_ended(self, still_busy: bool) -> None:
        now = time.perf_counter()
        self.steps += 1
        host = (now - self._call_start) - self._waited
        self._host_s += host
        self.recent_host_s = host if self.steps == 1 else 0.9 * self.recent_host_s + 0.1 * host
        if not still_busy and self._period_start is not None:
            self._busy_wall_s += now - self._period_start
            self._period_start = None

    # ---- around one collect ----
    def collected(self, dispatched_at: float, wait_started: float, ready_when_asked: bool) -> None:
        """A step dispatched at `dispatched_at` delivered its tokens; the host asked at
        `wait_started` and, unless they were ready then, has waited until now."""
        now = time.perf_counter()
        done_at = wait_started if ready_when_asked else now
        self._waited += now - wait_started
        start = max(dispatched_at, self._device_free_at)
        self._in_flight_s += max(0.0, done_at - start)
        self._device_free_at = max(self._device_free_at, done_at)

    def stats(self) -> StepTimingStats:
        wall = self._busy_wall_s
        if self._period_start is not None:
            wall += time.perf_counter() - self._period_start
        idle = 0.0 if wall <= 0 else max(0.0, 1.0 - self._in_flight_s / wall)
        host_ms = 1000.0 * self._host_s / self.steps if self.steps else 0.0
        return StepTimingStats(self.steps, host_ms, idle)
