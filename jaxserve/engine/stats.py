"""EngineStats: one snapshot of the engine's counters; the server's ServerInfo and the Prometheus
metrics are derived from it, never computed twice."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_kv_blocks_cached: int
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions: int
    num_compilations_after_warmup: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_requests_finished: int
    uptime_s: float
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0
    num_swapped_blocks: int = 0
    prefill_chunk_tokens: int = 0      # one request's most prompt tokens per step (0: no cap; a derived
                                       # chunk applies only to steps that carry decodes)
    prefix_cache_nodes: int = 0        # nodes in the prefix-cache tree, one per cached block (both tiers)
    # the host pool (one: swap preemption's blocks and the prefix cache's host tier, kv_offload_gib)
    prefix_cache_host_hits: int = 0    # of prefix_cache_hits, tokens loaded from the host tier
    num_host_blocks_total: int = 0
    num_host_blocks_cached: int = 0    # the host tier's blocks (evictable)
    num_host_blocks_in_use: int = 0    # swapped-out requests' blocks
    kv_offload_bytes_saved: int = 0    # device blocks' bytes the host tier took on eviction
    kv_offload_bytes_loaded: int = 0   # host-tier bytes loaded back for hits
    prefill_policy: str = ""           # how prompt chunks are sized (engine/chunk_policy.py), in words
    step_time_scale: float = 1.0       # measured / predicted time of steps with decodes and prompts (slo policy)
    host_ms_per_step: float = 0.0      # host time per step call outside waiting for the device
    device_idle_fraction: float = 0.0  # share of busy wall time with no step in flight (a lower bound)
    num_steps: int = 0                 # Engine.step calls that ran a step (host_ms_per_step's count)
    kv_cache_dtype: str = ""           # element type of the KV arena (the model's, or fp8/int8 when quantized)
    kv_cache_bytes_per_block: int = 0  # arena bytes one block of block_size tokens takes, all layers
    spec_num_draft_tokens: int = 0     # speculative guesses verified
    spec_num_accepted_tokens: int = 0  # of those, accepted
    spec_num_verifications: int = 0    # request-steps that verified guesses
    # where the model runs (jaxserve/parallel/mesh.py): devices it is split over, the processes
    # (hosts) they belong to, and the mesh's axis sizes ("model" is the tensor-parallel size)
    weights_version: str = ""          # the version the last update_weights named ("" : none)
    num_weight_updates: int = 0        # update_weights calls since start
    paused: bool = False               # pause() in effect: no step runs (a pause "wait" not yet done: False)
    num_requests_held: int = 0         # requests added while paused, queued at resume()
    asleep: bool = False               # sleep() in effect: the KV arena (and weights, level >= 1) given back
    sleep_level: int = -1              # the level of that sleep (runner/sleep.py); -1: awake
    # a mixture-of-experts model (engine/expert_load.py): tokens routed to each expert, summed
    # over its MoE layers, over the last steps and since start; the worst layer's max/mean load
    expert_tokens_window: tuple[int, ...] = ()
    expert_tokens_total: tuple[int, ...] = ()
    expert_load_imbalance: float = 0.0
    mesh_num_devices: int = 1
    mesh_num_hosts: int = 1
    mesh_axis_sizes: tuple[tuple[str, int], ...] = (("data", 1), ("model", 1))

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks held by live requests (cached-evictable blocks count as free)."""
        total = self.num_kv_blocks_total
        return 0.0 if not total else (total - self.num_kv_blocks_free - self.num_kv_blocks_cached) / total

    @property
    def prefix_hit_rate(self) -> float:
        return 0.0 if not self.prefix_cache_queries else self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def prefix_cache_device_hits(self) -> int:
        return self.prefix_cache_hits - self.prefix_cache_host_hits

    @property
    def spec_mean_accepted(self) -> float:
        """Guesses accepted per verification (each verification also samples one token itself)."""
        return 0.0 if not self.spec_num_verifications else self.spec_num_accepted_tokens / self.spec_num_verifications

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv_usage"] = self.kv_usage
        d["prefix_hit_rate"] = self.prefix_hit_rate
        d["spec_mean_accepted"] = self.spec_mean_accepted
        d["mesh_axis_sizes"] = dict(self.mesh_axis_sizes)
        return d


def scheduler_fields(s, config, bytes_per_block: int) -> dict:
    """The EngineStats fields read off the scheduler's SchedulerStats and config."""
    return dict(
        num_kv_blocks_total=s.num_kv_blocks_total,
        num_kv_blocks_free=s.num_kv_blocks_free,
        num_kv_blocks_cached=s.num_kv_blocks_cached,
        num_requests_running=s.num_running,
        num_requests_waiting=s.num_waiting,
        num_preemptions=s.num_preemptions,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions_recompute=s.num_preemptions_recompute,
        num_preemptions_swap=s.num_preemptions_swap,
        num_swapped_blocks=s.num_swapped_blocks,
        prefill_chunk_tokens=config.long_prefill_token_threshold or config.decode_step_prefill_cap,
        prefix_cache_nodes=s.prefix_cache_nodes,
        prefix_cache_host_hits=s.prefix_cache_host_hits,
        num_host_blocks_total=s.num_host_blocks_total,
        num_host_blocks_cached=s.num_host_blocks_cached,
        num_host_blocks_in_use=s.num_host_blocks_in_use,
        kv_offload_bytes_saved=s.kv_blocks_saved * bytes_per_block,
        kv_offload_bytes_loaded=s.kv_blocks_loaded * bytes_per_block,
        step_time_scale=s.step_time_scale,
        spec_num_draft_tokens=s.spec_num_draft_tokens,
        spec_num_accepted_tokens=s.spec_num_accepted_tokens,
        spec_num_verifications=s.spec_num_verifications,
    )


def mesh_fields(mesh) -> dict:
    """The stats fields of the mesh the runner's model is split over (parallel/mesh.py MeshInfo;
    None: one device, no fields)."""
    if mesh is None:
        return {}
    return dict(mesh_num_devices=mesh.num_devices, mesh_num_hosts=mesh.num_hosts, mesh_axis_sizes=mesh.axis_sizes)
