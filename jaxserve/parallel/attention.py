"""A layer's KV write and paged attention, run per tensor-parallel shard inside `jax.shard_map`.

Attention is independent per head, so each shard writes the K/V of its own KV heads into its
slice of the arena and attends its own query heads over them: no collective, and the paged
kernels (pallas_kernels: XLA on the CPU, Mosaic or Triton on a GPU, the reference) run
unchanged on a shard's [T, N/S, H] queries and [blocks, block_size, K'/S, H] arena. Under
`shard_map` XLA sees each kernel call as a per-device program, which the Pallas GPU kernels need
anyway (a custom call cannot be partitioned by GSPMD) and which keeps the arena from ever being
gathered. Everything else in the step (projections, norms, the MLP) is left to GSPMD
(parallel/sharding.py).
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from jaxserve.parallel.mesh import MODEL_AXIS
from jaxserve.parallel.sharding import KV_ARENA_SPEC

HEADS = P(None, MODEL_AXIS, None)           # q [T, N, H], k / v [T, K', H]
KV_SCALES = P(MODEL_AXIS)                   # a quantized arena's per-KV-head scales [K']


def per_shard(layer_attention: Callable, mesh: Mesh, quantized_kv: bool) -> Callable:
    """`layer_attention(q, k, v, k_cache, v_cache, scales, batch) -> (out, k_cache, v_cache)`
    (scales None or (k_scale [K], v_scale [K]); batch a dict of the step's replicated index
    arrays) run on each shard of `mesh`'s model axis with that shard's heads."""
    scale_spec = (KV_SCALES, KV_SCALES) if quantized_kv else None
    return jax.shard_map(
        layer_attention, mesh=mesh,
        in_specs=(HEADS, HEADS, HEADS, KV_ARENA_SPEC, KV_ARENA_SPEC, scale_spec, P()),
        out_specs=(HEADS, KV_ARENA_SPEC, KV_ARENA_SPEC),
        # the kernels' loops carry per-shard values shard_map cannot type as varying
        check_vma=False)
