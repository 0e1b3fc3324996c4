"""Preemption: the scheduler's component that evicts a running request when blocks run out (or,
under the priority policy, for a more urgent waiting one), by swap to the host pool or by
recompute, and counts what it did.

It owns its counters and decides; the scheduler (scheduler.py) owns the queues and the step:
it takes the victim out of the step being scheduled and back into the waiting queue, in front of
the requests that arrived after it, and puts the `Eviction`'s swap-outs in the step. Either way
the victim's output does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.sched.kv_cache_manager import KVCacheManager, cdiv
from jaxserve.sched.request import Request, RequestStatus
from jaxserve.sched.scheduler_config import SchedulerConfig


@dataclass(frozen=True, slots=True)
class Eviction:
    """What evicting a victim decided: its mode and, for a swap, the (device block, host-pool id)
    copies the step must run first."""

    swapped: bool
    swap_out: tuple[tuple[int, int], ...] = ()


class Preemption:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.num_recompute = 0
        self.num_swap = 0
        self.num_swapped_blocks = 0  # blocks copied out to the host pool, in total

    def less_urgent(self, req: Request, running: Sequence[Request], admitted: set[str]) -> list[Request]:
        """The running requests a waiting `req` may evict under the priority policy: less urgent
        ones, not admitted in this very step (their swap-in or first chunk is not even computed
        yet), never its own fork parent."""
        if self.config.scheduling_policy != "priority":
            return []
        parent = req.fork_parent_id
        return [r for r in running
                if r.priority > req.priority and r.request_id not in admitted and r.request_id != parent]

    def evict(self, victim: Request, may_swap: bool) -> Eviction:
        """Free the victim's device blocks: saved to the host pool (swap) when allowed and worth it,
        else dropped (recompute). `may_swap` is False when some of its blocks still wait for their
        content in this step (swap-outs run before the step's copies and swap-ins)."""
        victim.num_preemptions += 1
        if may_swap and self._should_swap(victim):
            k = cdiv(victim.num_computed_tokens, self.config.block_size)
            host = self.kv.take_host(k)
            pairs = tuple(zip(victim.block_ids[:k], host))
            victim.host_block_ids = host
            self.kv.free(victim)
            victim.status = RequestStatus.SWAPPED
            self.num_swap += 1
            self.num_swapped_blocks += k
            return Eviction(True, pairs)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        self.num_recompute += 1
        return Eviction(False)

    def _should_swap(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or req.num_computed_tokens == 0:
            return False
        if cdiv(req.num_computed_tokens, self.config.block_size) > self.kv.num_host_available:
            return False  # the host pool is full (swapped requests): recompute instead
        if mode == "swap":
            return True
        # auto: recompute is cheaper below the crossover length the engine measured; blocks still
        # in the prefix cache would be found again, so they do not count as lost work
        lost = req.num_computed_tokens - self.kv.num_cached_prefix_tokens(req)
        return lost >= self.config.swap_crossover_tokens

    def drop_swapped(self, req: Request) -> None:
        """A swapped request's host blocks hold K/V that must not be read (a weight update): it
        becomes one preempted by recompute."""
        self.kv.host_pool.free(req.host_block_ids)
        req.host_block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
