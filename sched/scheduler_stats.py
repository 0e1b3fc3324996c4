"""The scheduler's counters, read by the engine's stats(): seats, queues, preemptions, KV blocks,
prefix-cache hits. A mixin of `Scheduler` (scheduler.py); every one is a view of its state."""

from __future__ import annotations


class SchedulerStats:
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def num_kv_blocks_total(self) -> int:
        return self.kv.pool.num_total

    @property
    def num_kv_blocks_free(self) -> int:
        return self.kv.pool.num_free

    @property
    def num_kv_blocks_cached(self) -> int:
        """Blocks the prefix cache holds that no request uses (evictable)."""
        return self.kv.pool.num_cached

    @property
    def num_kv_blocks_in_use(self) -> int:
        return self.kv.pool.num_in_use

    @property
    def num_host_blocks_in_use(self) -> int:
        return self.host_pool.num_in_use if self.host_pool is not None else 0

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv.prefix_cache_hits

    @property
    def prefix_cache_nodes(self) -> int:
        return self.kv.num_prefix_cache_nodes
