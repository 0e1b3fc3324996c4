"""The garbage collector's pace for a process that runs an engine's step loop.

Each step makes a few objects per running request (the scheduled request, its update, its output
and their lists): a few thousand a step at 256 requests, nearly all freed by reference counting
within a step or two. Python collects its youngest generation once tracked allocations outrun
frees by 700, so at that batch the collector ran several times a step, each pass walking every
young object still alive (the step's own, in flight), and its middle generation every ten of
those: about 0.15 ms of a 2.3 ms host step on our CPU (docs/benchmarks.md "The host path"). A
higher threshold lets the step's objects die by reference count before a pass sees them.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def pace_collector(threshold0: int | None) -> None:
    """Raise the youngest generation's threshold to `threshold0` for the whole process (never
    lower it: a process that chose a higher one keeps it); None changes nothing."""
    if threshold0 is None:
        return
    current = gc.get_threshold()
    if current[0] < threshold0:
        gc.set_threshold(threshold0, *current[1:])
        log.info("garbage collector: youngest generation every %d net allocations (was %d)", threshold0, current[0])
