"""One snapshot of the scheduler's state and counters (`Scheduler.stats()`), read by the engine's
stats(): seats, queues, preemptions, KV blocks in both tiers, prefix-cache hits, speculation.
A value, taken at once: nothing in it changes as the scheduler goes on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_kv_loading: int                 # requests whose KV is on its way from elsewhere (kv_connector.py)
    kv_loads_started: int
    kv_loads_done: int
    kv_load_fallbacks: tuple[tuple[str, int], ...]   # (reason, loads recomputed or failed)
    kv_stale_results: int               # load results dropped: their load was cancelled
    num_preemptions_recompute: int
    num_preemptions_swap: int
    num_swapped_blocks: int             # blocks copied out by swap preemption, in total
    # the device pool: free + cached (evictable) + in use == total
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_kv_blocks_cached: int
    num_kv_blocks_in_use: int
    num_kv_blocks_in_use_peak: int
    # the host pool: free + cached (the prefix cache's host tier) + in use (swapped requests) == total
    num_host_blocks_total: int
    num_host_blocks_free: int
    num_host_blocks_cached: int
    num_host_blocks_in_use: int
    prefix_cache_queries: int           # prompt tokens looked up at first admission
    prefix_cache_hits: int              # of those, found in either tier
    prefix_cache_host_hits: int         # of those, loaded from the host tier
    prefix_cache_nodes: int             # nodes in the tree (both tiers)
    kv_blocks_saved: int                # device blocks the host tier took on eviction
    kv_blocks_loaded: int               # host-tier blocks loaded back for a hit
    kv_host_evictions: int              # host-tier blocks forgotten for room
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_num_verifications: int
    step_time_scale: float

    @property
    def num_preemptions(self) -> int:
        return self.num_preemptions_recompute + self.num_preemptions_swap

    @property
    def prefix_cache_device_hits(self) -> int:
        return self.prefix_cache_hits - self.prefix_cache_host_hits

    @property
    def kv_usage(self) -> float:
        """Fraction of the device pool's blocks held by live requests (cached-evictable blocks
        count as free)."""
        total = self.num_kv_blocks_total
        return 0.0 if not total else (total - self.num_kv_blocks_free - self.num_kv_blocks_cached) / total

    @property
    def prefix_hit_rate(self) -> float:
        return 0.0 if not self.prefix_cache_queries else self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def spec_mean_accepted(self) -> float:
        """Guesses accepted per verification (each verification also samples one token itself)."""
        return 0.0 if not self.spec_num_verifications else self.spec_num_accepted_tokens / self.spec_num_verifications


def snapshot(sched) -> SchedulerStats:
    """The snapshot of a Scheduler (scheduler.py calls this from stats())."""
    pool, host, kv, cache, spec = sched.kv.pool, sched.host_pool, sched.kv, sched.kv.cache, sched.speculation
    return SchedulerStats(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_kv_loading=sched.kv_loads.num_in_flight,
        kv_loads_started=sched.kv_loads.num_started,
        kv_loads_done=sched.kv_loads.num_done,
        kv_load_fallbacks=tuple(sorted(sched.kv_loads.fallbacks.items())),
        kv_stale_results=sched.kv_loads.num_stale_results,
        num_preemptions_recompute=sched.preemption.num_recompute,
        num_preemptions_swap=sched.preemption.num_swap,
        num_swapped_blocks=sched.preemption.num_swapped_blocks,
        num_kv_blocks_total=pool.num_total,
        num_kv_blocks_free=pool.num_free,
        num_kv_blocks_cached=pool.num_cached,
        num_kv_blocks_in_use=pool.num_in_use,
        num_kv_blocks_in_use_peak=sched.num_kv_blocks_in_use_peak,
        num_host_blocks_total=host.num_total if host is not None else 0,
        num_host_blocks_free=host.num_free if host is not None else 0,
        num_host_blocks_cached=host.num_cached if host is not None else 0,
        num_host_blocks_in_use=host.num_in_use if host is not None else 0,
        prefix_cache_queries=kv.prefix_cache_queries,
        prefix_cache_hits=kv.prefix_cache_hits,
        prefix_cache_host_hits=kv.prefix_cache_host_hits,
        prefix_cache_nodes=kv.num_prefix_cache_nodes,
        kv_blocks_saved=cache.num_saved_blocks if cache is not None else 0,
        kv_blocks_loaded=cache.num_loaded_blocks if cache is not None else 0,
        kv_host_evictions=cache.num_host_evictions if cache is not None else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec is not None else 0,
        spec_num_verifications=spec.num_verifications if spec is not None else 0,
        step_time_scale=sched.step_time_scale,
    )
