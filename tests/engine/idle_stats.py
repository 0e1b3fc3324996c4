"""A scheduler snapshot with nothing in it, for tests that build an EngineStats by hand."""

import dataclasses

from jaxserve.sched.scheduler_stats import SchedulerStats


def idle_scheduler_stats(**counts) -> SchedulerStats:
    zeros = {f.name: 0 for f in dataclasses.fields(SchedulerStats)}
    return SchedulerStats(**{**zeros, "kv_load_fallbacks": (), "step_time_scale": 1.0, **counts})
