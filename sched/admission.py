"""Admission against projected KV use: the scheduler's component that says whether a waiting
request may take blocks now, and how many it must leave free.

Blocks in use, plus the growth each running request is expected to need (its prompt and a share
`admission_output_share` of its remaining max_tokens), plus the newcomer's, must fit the pool less
a watermark, so a burst of admissions cannot force preemptions on the next token. A request alone
always fits (the door checked that it can ever run). It reads the KV manager's pool; its one piece
of state is the running requests' summed growth, kept through one admission pass (a running
request's counts do not change while others are admitted, and admitted ones join the end of the
list), so admitting k requests beside n running costs O(n + k), not O(n * k): the scheduler calls
`new_pass` wherever the running requests may have changed otherwise (a step scheduled or
updated, a request preempted or ended).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jaxserve.sched.kv_cache_manager import KVCacheManager, SharedPrefix, cdiv
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler_config import SchedulerConfig


class Admission:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        # this pass: the summed growth of the running list's first `_counted` requests
        self._counted = 0
        self._growth = 0

    def new_pass(self) -> None:
        """Running requests may have changed (scheduled, updated, preempted, ended) since the last
        admission: forget their growth."""
        self._counted = self._growth = 0

    def admits(self, req: Request, prefix: SharedPrefix, running: Sequence[Request]) -> bool:
        """Whether req (sharing `prefix`) fits the projection beside the running requests."""
        if not running:
            return True
        growth = self.running_growth(running)
        need = self.projected_blocks(req) - self.kv.num_prefix_blocks_in_use(prefix)
        limit = self.kv.pool.num_total - self.config.watermark_blocks
        return self.kv.pool.num_in_use + growth + need <= limit

    def admits_after_evicting(self, req: Request, prefix: SharedPrefix, running: Sequence[Request],
                              evicted: Sequence[Request]) -> bool:
        """Whether req would pass `admits` once the running requests `evicted` gave their blocks
        back. A preemption for a newcomer is made only if this holds for every request it may
        evict: otherwise it frees nothing the newcomer can use, and the victim, re-admitted at the
        next step, can evict another in turn, round after round (a livelock under priorities)."""
        gone = {r.request_id for r in evicted}
        rest = [r for r in running if r.request_id not in gone]
        if not rest:
            return True
        pool = self.kv.pool
        dropped: dict[int, int] = {}
        for r in evicted:
            for b in r.block_ids:
                dropped[b] = dropped.get(b, 0) + 1
        freed = sum(1 for b, k in dropped.items() if pool.refcount(b) == k)
        growth = sum(max(0, self.projected_blocks(r) - len(r.block_ids)) for r in rest)
        shared = sum(1 for b in prefix.block_ids if pool.refcount(b) > dropped.get(b, 0))
        need = self.projected_blocks(req) - shared
        return pool.num_in_use - freed + growth + need <= pool.num_total - self.config.watermark_blocks

    def running_growth(self, running: Sequence[Request]) -> int:
        """Blocks the running requests are expected to take beyond what they hold."""
        if self._counted > len(running):      # shrunk without new_pass: count afresh
            self.new_pass()
        # the requests joined since the last call (admitted in this pass: after their chunk)
        for r in running[self._counted:]:
            self._growth += max(0, self.projected_blocks(r) - len(r.block_ids))
        self._counted = len(running)
        return self._growth

    def reserve(self, running: Sequence[Request]) -> int:
        """Blocks an admission must leave free beyond its own (the watermark; none when alone)."""
        return self.config.watermark_blocks if running else 0

    def projected_blocks(self, req: Request) -> int:
        remaining = req.max_tokens - req.num_outputs_with_pending
        share = math.ceil(self.config.admission_output_share * remaining)
        return cdiv(min(req.num_tokens + share, req.num_prompt_tokens + req.max_tokens - 1), self.config.block_size)
