"""Scratch steps: made-up requests that run the compiled steps outside serving (warm-up, calibration).

Their token ids are all 0 and their K/V land in blocks no request owns: the null block (block 0,
which padding rows write anyway) for warm-up, whose results are thrown away, and blocks 1, 2, ...
for the measurements, whose contexts must be real. The latter may only run while no request
holds blocks and the prefix cache is empty (before the first request, or Engine.run_idle_work):
they overwrite blocks a live engine's requests and prefix cache would hold.
"""

from __future__ import annotations

from jaxserve.sched.scheduler_output import ScheduledRequest, SchedulerOutput


def scratch_request(request_id: str, num_tokens: int, num_computed: int, *, block_size: int,
                    null_blocks: bool = False) -> ScheduledRequest:
    """A greedy request of `num_tokens` new tokens after `num_computed` cached ones, on the scratch
    blocks 1, 2, ... or, with `null_blocks`, on the null block alone."""
    end = num_computed + num_tokens
    num_blocks = -(-end // block_size)
    blocks = (0,) * num_blocks if null_blocks else tuple(range(1, 1 + num_blocks))
    return ScheduledRequest(request_id, (0,) * num_tokens, num_computed, blocks, True, 0)


def scratch_step(requests) -> SchedulerOutput:
    requests = tuple(requests)
    return SchedulerOutput(requests, sum(len(r.token_ids) for r in requests))
