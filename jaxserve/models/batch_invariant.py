"""Batch invariance: a row's results that never depend on what else its program computes.

XLA:CPU picks a dot's kernel by its row count (M = 1 | 2..63 | >= 64 at SmolLM2's widths give a
row different last bits) and vectorizes a row reduction (RMSNorm's mean) across rows once there
are enough of them, so a request's logits change in their last bits with the step's bucket and
its neighbours (docs/rl.md). In the batch-invariant mode every such row-wise computation runs on
fixed tiles of ROW_TILE rows, one `lax.map` iteration a tile: each tile is the same program
whatever the step's row count, and a row's result within a tile does not depend on the other
rows (measured: a row at any offset of any T from 1 to 513 gives the same bits). Attention has
its own batch-invariant form (models/invariant_attention.py).

The mode is a trace-time switch (a context variable), not an argument threaded through every
module: the runner traces its steps inside `batch_invariant()` when the engine asks for it, and
`jaxserve.reference_logprobs(..., batch_invariant=True)` traces the trainer's replay inside it,
so both run the same tiled kernels and agree bit for bit.

What it costs: the tiles serialize a step's matmuls and each tile reads the weights again (a
256-row prefill step reads them 8 times with 32-row tiles), and a decode of one row computes a
whole tile; docs/benchmarks.md measures it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import jax
import jax.numpy as jnp

# rows per tile: a multiple of the CPU's vector width (8 float32 lanes), so no row of a tile
# takes a scalar remainder path, and in the dot's "2..63 rows" regime
ROW_TILE = 32

_ACTIVE = contextvars.ContextVar("jaxserve_batch_invariant", default=False)


def active() -> bool:
    """Whether the code being traced now runs in the batch-invariant mode."""
    return _ACTIVE.get()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Trace inside this to get the batch-invariant kernels (`enabled=False`: the default ones)."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def fixed_map(fn: Callable, *xs: jax.Array):
    """fn over the items of xs' leading axis, one loop iteration an item: `lax.map` whose loop
    body is the same program whatever the item count. Returns fn's outputs stacked (a pytree).

    Two things make a plain `lax.map` (or a vmap) round an item differently with the count:
    XLA inlines a loop it knows runs once and fuses the body with its neighbours, and a slice of
    one item from a buffer of exactly one item is the whole buffer, so XLA drops it and emits the
    item's arithmetic differently (a multiply-add contracted to an FMA or not). Here the trip
    count is a traced value and every buffer holds one spare item."""
    n = xs[0].shape[0]
    padded = [jax.lax.optimization_barrier(jnp.pad(x, [(0, 1)] + [(0, 0)] * (x.ndim - 1))) for x in xs]
    item_shapes = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs))
    count = jax.lax.optimization_barrier(jnp.int32(n))

    def body(i, outs):
        results = fn(*(jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in padded))
        return jax.tree.map(lambda o, r: jax.lax.dynamic_update_index_in_dim(o, r, i, 0), outs, results)

    outs = jax.tree.map(lambda s: jnp.zeros((n + 1,) + s.shape, s.dtype), item_shapes)
    outs = jax.lax.optimization_barrier(jax.lax.fori_loop(0, count, body, outs))
    return jax.tree.map(lambda o: o[:n], outs)


def row_tiled(fn: Callable[..., jax.Array], *xs: jax.Array, tile: int = ROW_TILE) -> jax.Array:
    """fn applied to the rows of xs on fixed [tile, C_i] tiles: every axis of xs[0] but the last
    is a row axis, the other xs have as many rows; fn maps tiles [tile, C_i] -> [tile, C'] row by
    row. Returns [*xs[0].shape[:-1], C']. Padding rows are zeros (fn must keep rows apart, as a
    matmul or a per-row norm does)."""
    lead = xs[0].shape[:-1]
    rows = [x.reshape(-1, x.shape[-1]) for x in xs]
    n = rows[0].shape[0]
    if any(r.shape[0] != n for r in rows):
        raise ValueError(f"row_tiled: inputs of {[r.shape[0] for r in rows]} rows")
    tiles = [jnp.pad(r, ((0, -n % tile), (0, 0))).reshape(-1, tile, r.shape[-1]) for r in rows]
    out = fixed_map(fn, *tiles)                                             # [n_tiles, tile, C']
    return out.reshape(-1, out.shape[-1])[:n].reshape(*lead, out.shape[-1])


def log_softmax(logits: jax.Array) -> jax.Array:
    """log_softmax over the last axis; on fixed row tiles in the mode (the sampler's logprobs and
    the replay's take the same path, so their reductions over the vocabulary agree)."""
    fn = lambda rows: jax.nn.log_softmax(rows, axis=-1)
    return row_tiled(fn, logits) if active() else fn(logits)
