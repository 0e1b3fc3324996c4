"""EngineStats: one snapshot of the engine's counters, a composition of the parts that keep them;
the server's ServerInfo and the Prometheus metrics are read from it, never computed twice.

The scheduler's own snapshot (sched/scheduler_stats.py SchedulerStats: seats, queues, KV blocks
in both tiers, prefix-cache hits, preemptions, speculation) is embedded as it is, so a counter the
scheduler gains is one field there and one line where a front exposes it. The engine adds what
only it knows: the arena's element type and block size, the step loop's timing, the requests'
token totals, weights, pause and sleep, a mixture-of-experts model's expert load, the mesh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from jaxserve.parallel.mesh import DATA_AXIS, MODEL_AXIS, MeshInfo
from jaxserve.sched.scheduler_stats import SchedulerStats

ONE_DEVICE = MeshInfo(1, 1, ((DATA_AXIS, 1), (MODEL_AXIS, 1)), "")   # a runner that reports no mesh


@dataclass(frozen=True, slots=True)
class KVArenaStats:
    """The KV arena: its element type (the model's, or fp8/int8 when quantized), the bytes one
    block of block_size tokens takes over all layers, and the host tier's traffic in bytes."""

    dtype: str = ""
    bytes_per_block: int = 0
    offload_bytes_saved: int = 0      # device blocks' bytes the host tier took on eviction
    offload_bytes_loaded: int = 0     # host-tier bytes loaded back for hits

    @classmethod
    def of(cls, arena, s: SchedulerStats) -> "KVArenaStats":
        """The stats of an arena (runner/kv_arena.py ArenaSpec; None: a runner without one)."""
        if arena is None:
            return cls()
        bpb = arena.bytes_per_block
        return cls(str(arena.dtype), bpb, s.kv_blocks_saved * bpb, s.kv_blocks_loaded * bpb)


@dataclass(frozen=True, slots=True)
class StepStats:
    """The step loop (engine/step_timing.py) and what it runs."""

    num_steps: int = 0                       # Engine.step calls that ran a step
    host_ms_per_step: float = 0.0            # host time per step call outside waiting for the device
    device_idle_fraction: float = 0.0        # share of busy wall time with no step in flight (a lower bound)
    num_compilations_after_warmup: int = 0   # this engine's own, since it was built
    prefill_policy: str = ""                 # how prompt chunks are sized (engine/chunk_policy.py), in words
    # one request's most prompt tokens per step (0: no cap; a derived chunk applies only to
    # steps that carry decodes)
    prefill_chunk_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RequestTotals:
    """Requests and tokens since start (the output processor's counters)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_finished: int = 0
    num_held: int = 0                 # added while paused, queued at resume()


@dataclass(frozen=True, slots=True)
class WeightStats:
    version: str = ""                 # the version the last update_weights named ("": none)
    num_updates: int = 0              # update_weights calls since start


@dataclass(frozen=True, slots=True)
class Lifecycle:
    uptime_s: float = 0.0
    paused: bool = False              # pause() in effect (a pause "wait" not yet done: False)
    asleep: bool = False              # sleep() in effect: the arena (and weights, level >= 1) given back
    sleep_level: int = -1             # the level of that sleep (runner/sleep.py); -1: awake


@dataclass(frozen=True, slots=True)
class ExpertLoadStats:
    """A mixture-of-experts model (engine/expert_load.py): tokens routed to each expert, summed
    over its MoE layers, over the last steps and since start; the worst layer's max/mean load."""

    tokens_window: tuple[int, ...] = ()
    tokens_total: tuple[int, ...] = ()
    imbalance: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    scheduler: SchedulerStats
    kv: KVArenaStats = field(default_factory=KVArenaStats)
    steps: StepStats = field(default_factory=StepStats)
    requests: RequestTotals = field(default_factory=RequestTotals)
    weights: WeightStats = field(default_factory=WeightStats)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    experts: ExpertLoadStats = field(default_factory=ExpertLoadStats)
    # where the model runs (jaxserve/parallel/mesh.py): devices it is split over, the processes
    # (hosts) they belong to, and the mesh's axis sizes ("model" is the tensor-parallel size)
    mesh: MeshInfo = ONE_DEVICE

    def as_dict(self) -> dict:
        """The snapshot as nested JSON-ready dicts, one per part, with the scheduler's derived
        rates (kv_usage, prefix_hit_rate, spec_mean_accepted) beside its counters."""
        d = asdict(self)
        s = self.scheduler
        d["scheduler"].update(kv_usage=s.kv_usage, prefix_hit_rate=s.prefix_hit_rate,
                              prefix_cache_device_hits=s.prefix_cache_device_hits,
                              num_preemptions=s.num_preemptions, spec_mean_accepted=s.spec_mean_accepted)
        d["scheduler"]["kv_load_fallbacks"] = dict(s.kv_load_fallbacks)
        d["mesh"] = self.mesh.as_dict()
        return d
