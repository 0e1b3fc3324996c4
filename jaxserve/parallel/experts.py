"""Expert parallelism: a mixture-of-experts layer's experts split over the mesh's "expert" axis,
tokens dispatched to the devices that hold their experts and combined with JAX collectives.

The mesh of a MoE engine is ("data", "expert", "model") (parallel/mesh.py): attention heads split
over "model" as in tensor parallelism and replicated over "expert"; experts split over "expert"
(shard i holds experts [i E/EP, (i+1) E/EP)), and inside each expert its intermediate columns split
over "model" as the dense MLP's are (gate|up column-parallel, stored shard-major; down
row-parallel). Capacity-free: nothing is dropped, so outputs equal one device's up to the order of
float sums. Both forms below run inside `jax.shard_map` over the whole mesh and call the layer of
models/moe.py on each device's own experts (`moe_mlp(..., expert_offset=)`).

Between layers the activations are replicated (the row-parallel projections end in an
all-reduce), so every device already holds every token, and:

    ALL_GATHER   "all-gather + reduce-scatter": the all-gather is the replication the step
                 already has; each device runs its experts over the tokens routed to them and
                 one psum over ("expert", "model") (a reduce-scatter + all-gather, the all-reduce
                 a dense MLP's TP ends in too) sums the shards' outputs. One collective of [T, D].
    ALL_TO_ALL   each expert shard takes 1/EP of the tokens, sends each (token, slot) to the shard
                 of its expert (all-to-all), the shard runs its experts on what it received and
                 sends the results back (all-to-all), the owner combines its tokens' k results,
                 a psum over "model" sums the intermediate-column split and an all-gather over
                 "expert" replicates the tokens again. Capacity-free with static shapes means each
                 shard's send buffer holds, for every destination, room for all its T/EP * k
                 slots: [EP, T/EP * k, D], EP times what it sends on average.

Which is cheaper (docs/benchmarks.md, "Mixture of experts", measured by
`python -m jaxserve.bench.expert_report`): ALL_GATHER at every step size measured on CPU fake
devices, decode and prefill (fewer collectives, no padded buffers, and no token slicing: the
tokens are replicated anyway). `dispatch_for(rows)` is the engine's choice per compiled step.
ALL_TO_ALL is kept, tested equal, for meshes where tokens are not replicated between layers
(data-parallel attention), where it sends each token once instead of reducing [T, D] everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.models.moe import ExpertWeights, Routing, moe_mlp
from jaxserve.parallel.mesh import EXPERT_AXIS, MODEL_AXIS

ALL_GATHER, ALL_TO_ALL, AUTO = "all_gather", "all_to_all", "auto"
DISPATCH_FORMS = (ALL_GATHER, ALL_TO_ALL)


def dispatch_for(rows: int, choice: str = AUTO) -> str:
    """The dispatch form a step of `rows` token rows uses: `choice` unless "auto", which is
    ALL_GATHER at every size (the measurements in the module doc; `rows` is the seam where a
    measured crossover would go)."""
    if choice == AUTO:
        return ALL_GATHER
    if choice not in DISPATCH_FORMS:
        raise ValueError(f"expert dispatch {choice!r} must be one of {(AUTO, *DISPATCH_FORMS)}")
    return choice


def check_expert_sizes(num_experts: int, moe_intermediate_size: int, expert_parallel_size: int,
                       tensor_parallel_size: int) -> None:
    """Refuse sizes that do not divide, naming those that work: the experts split whole over
    "expert", each expert's intermediate columns evenly over "model". `num_experts` 0: a dense
    model, which has nothing to split over "expert"."""
    ep, tp = expert_parallel_size, tensor_parallel_size
    if ep == 1 and (num_experts == 0 or tp == 1):
        return
    if num_experts == 0:
        raise ValueError(f"expert_parallel_size={ep} needs a mixture-of-experts model; this one is dense "
                         f"(use tensor_parallel_size to split it)")
    if num_experts % ep:
        working = [s for s in range(1, num_experts + 1) if num_experts % s == 0]
        raise ValueError(f"expert_parallel_size={ep} does not divide the model's {num_experts} experts: sizes "
                         f"that work are {', '.join(map(str, working))}")
    if moe_intermediate_size % tp:
        working = [s for s in range(1, moe_intermediate_size + 1) if moe_intermediate_size % s == 0]
        raise ValueError(f"tensor_parallel_size={tp} does not divide each expert's {moe_intermediate_size} "
                         f"intermediate columns (split over the tensor-parallel devices): sizes that work "
                         f"are {', '.join(map(str, working[:16]))}{' ...' if len(working) > 16 else ''}")


def expert_leaf_spec(module: str, leaf: str, shape: tuple[int, ...]) -> P:
    """The PartitionSpec of one leaf of a stacked expert projection: experts on "expert", and the
    intermediate columns on "model": gate_up [E, D, 2F] (every leaf's last axis: its outputs,
    shard-major) and down [E, F, D] (axis 1: its inputs, or quantization groups along them; a
    per-channel scale [E, 1, D] is applied after the sum, replicated)."""
    if module == "gate_up":
        return P(EXPERT_AXIS, *([None] * (len(shape) - 2)), MODEL_AXIS)
    if module == "down":
        if len(shape) == 3 and shape[1] > 1:
            return P(EXPERT_AXIS, MODEL_AXIS, None)
        return P(EXPERT_AXIS, *([None] * (len(shape) - 1)))
    raise ValueError(f"expert projection {module!r} is not gate_up or down")


def experts_specs(experts: ExpertWeights) -> ExpertWeights:
    """ExpertWeights of PartitionSpecs matching `experts`' leaves."""
    return ExpertWeights(gate_up={k: expert_leaf_spec("gate_up", k, v.shape) for k, v in experts.gate_up.items()},
                         down={k: expert_leaf_spec("down", k, v.shape) for k, v in experts.down.items()})


@dataclass(frozen=True)
class ExpertParallel:
    """The expert layer over `mesh`: call it as models/moe.py's `moe_mlp` is called, with the
    global ExpertWeights (sharded as `experts_specs` says) and replicated x and routing."""

    mesh: Mesh
    dispatch: str = ALL_GATHER
    impl: str | None = None              # moe.py's grouped-matmul form (None: by platform)

    def __call__(self, x: jax.Array, routing: Routing, experts: ExpertWeights, *,
                 activation: Callable) -> jax.Array:
        ep = self.mesh.shape[EXPERT_AXIS]
        dispatch = ALL_GATHER if ep == 1 else self.dispatch    # one expert shard: nothing to dispatch
        body = _all_gather if dispatch == ALL_GATHER else _all_to_all
        if dispatch not in DISPATCH_FORMS:
            raise ValueError(f"dispatch={dispatch!r} must be one of {DISPATCH_FORMS}")

        def run(x, routing, experts):
            return body(x, routing, experts, activation=activation, impl=self.impl)

        return jax.shard_map(run, mesh=self.mesh, in_specs=(P(), P(), experts_specs(experts)), out_specs=P(),
                             # the grouped matmul's gathers carry per-shard values shard_map cannot type
                             check_vma=False)(x, routing, experts)


def _all_gather(x, routing: Routing, experts: ExpertWeights, *, activation, impl):
    """x [T, D] and routing replicated -> [T, D]: this shard's experts over the tokens routed to
    them, summed over every shard (and every slice of the intermediate columns)."""
    offset = jax.lax.axis_index(EXPERT_AXIS) * experts.num_experts
    partial = moe_mlp(x, routing, experts, activation=activation, expert_offset=offset, impl=impl)
    return jax.lax.psum(partial, (EXPERT_AXIS, MODEL_AXIS))


def _all_to_all(x, routing: Routing, experts: ExpertWeights, *, activation, impl):
    """x [T, D] and routing replicated -> [T, D], through an all-to-all to the experts' shards and
    one back (module doc)."""
    local = experts.num_experts
    ep = jax.lax.axis_size(EXPERT_AXIS)
    shard = jax.lax.axis_index(EXPERT_AXIS)
    t, d = x.shape
    k = routing.expert_ids.shape[1]
    per_shard = -(-t // ep)                               # this shard's tokens: [shard * Tl, (shard + 1) * Tl)
    pad = per_shard * ep - t
    ids, weights = routing.expert_ids, routing.weights
    if pad:                                               # padding rows: weight 0, never combined
        x = jnp.pad(x, ((0, pad), (0, 0)))
        ids = jnp.pad(ids, ((0, pad), (0, 0)))
        weights = jnp.pad(weights, ((0, pad), (0, 0)))
    start = shard * per_shard
    mine = jax.lax.dynamic_slice_in_dim(x, start, per_shard)                     # [Tl, D]
    my_ids = jax.lax.dynamic_slice_in_dim(ids, start, per_shard).reshape(-1)      # [A], A = Tl * K
    my_weights = jax.lax.dynamic_slice_in_dim(weights, start, per_shard)          # [Tl, K]
    slots = my_ids.shape[0]

    # pack: each destination's slots first in its row of the send buffer, in slot order
    dest = my_ids // local                                                       # [A]
    order = jnp.argsort(dest, stable=True)
    dest_sorted = dest[order]
    counts = jnp.zeros((ep,), jnp.int32).at[dest].add(1)
    first = jnp.cumsum(counts) - counts
    place = jnp.arange(slots, dtype=jnp.int32) - first[dest_sorted]              # [A]: position in its row
    send = jnp.zeros((ep, slots, d), x.dtype).at[dest_sorted, place].set(mine[order // k])
    # the expert each sent row wants, as a global id; -1 marks an empty row (no expert holds it)
    send_ids = jnp.full((ep, slots), -1, jnp.int32).at[dest_sorted, place].set(my_ids[order])

    received = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0)                      # [EP (source), A, D]
    received_ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0)
    # every received row is a "token" routed to one expert with weight 1: the layer of one device
    one_slot = Routing(expert_ids=received_ids.reshape(-1, 1),
                       weights=jnp.ones((ep * slots, 1), jnp.float32))
    y = moe_mlp(received.reshape(ep * slots, d), one_slot, experts, activation=activation,
                expert_offset=shard * local, impl=impl)                          # [EP * A, D]
    returned = jax.lax.all_to_all(y.reshape(ep, slots, d), EXPERT_AXIS, 0, 0)    # [EP (dest), A, D]

    results = jnp.zeros((slots, d), y.dtype).at[order].set(returned[dest_sorted, place])   # [A, D], slot order
    combined = jnp.einsum("tkd,tk->td", results.reshape(per_shard, k, d).astype(jnp.float32), my_weights,
                          precision=jax.lax.Precision.HIGHEST).astype(x.dtype)   # [Tl, D]
    if jax.lax.axis_size(MODEL_AXIS) > 1:       # XLA keeps even a one-device all-reduce
        combined = jax.lax.psum(combined, MODEL_AXIS)
    return jax.lax.all_gather(combined, EXPERT_AXIS, tiled=True)[:t]
