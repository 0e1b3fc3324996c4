"""Ragged paged attention for CUDA GPUs before Hopper (Ampere, Ada), on Pallas' Triton backend.

Upstream deprecates the Triton backend in favour of Mosaic GPU, so this module stands alone:
deleting it (and its branch in `dispatch.choose`) removes it. It also serves float32 on every GPU,
which the Mosaic GPU kernel does not take.

One program per (KV head, work item, split) (see `work_plan`): it loads the item's tile of query
rows once (16 rows in decode-only buckets, 64 where prefill rows fit, so a prompt re-reads its
KV fewer times), walks the sequence's block table one cache block at a time within its share of
the key range, and keeps an online softmax in float32. Triton needs power-of-two tensor sizes and
matmul dimensions >= 16, hence `rows` in {16, 32, 64, ...} and block sizes >= 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import work_plan as wp
from pallas_kernels.kv_quant import is_quantized_kv


def _kernel(meta_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
            rows, group, block_size, num_splits, sm_scale, sliding_window, soft_cap):
    # meta_ref [W, 32], bt_ref [S, Wb], q_ref [K, R, H], k_ref/v_ref [num_blocks, block_size, K, H]
    # o_ref [rows, H] f32, lse_ref [rows] f32 (this program's slices)
    kh, item, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = meta_ref[item, wp.SEQ]
    row0 = meta_ref[item, wp.ROW0]
    lrow0 = meta_ref[item, wp.LROW0]
    kv_len = meta_ref[item, wp.KV_LEN]
    q_len = meta_ref[item, wp.Q_LEN]
    lo, hi = wp.split_range(meta_ref[item, wp.TILE_LO], meta_ref[item, wp.TILE_HI], split, num_splits)
    head_dim = q_ref.shape[-1]

    q = q_ref[kh, pl.ds(row0, rows), :]                                   # [rows, H]
    # float32 dots on the GPU default to TF32 in the Triton lowering: ask for true float32.
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    # Rows past the item's end belong to the next item; clamping keeps their softmax finite.
    token = jnp.minimum((lrow0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)) // group,
                        jnp.maximum(q_len - 1, 0))
    q_pos = kv_len - q_len + token                                        # [rows, 1]

    def body(j, carry):
        acc, m, l = carry
        block = bt_ref[seq, j]
        # a quantized cache (fp8 / int8, kv_quant.py) widens to q's dtype here; a float one is q's
        k = k_ref[block, :, kh, :].astype(q.dtype)                        # [block_size, H]
        v = v_ref[block, :, kh, :].astype(q.dtype)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision) * sm_scale  # [rows, block_size]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key = j * block_size + lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        ok = key <= q_pos
        if sliding_window is not None:
            ok &= key > q_pos - sliding_window
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)                 # fully masked so far
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        # Slots past kv_len may hold anything (NaN in tests): never let them reach the sum.
        v = jnp.where(jnp.reshape(key, (block_size, 1)) < kv_len, v, jnp.zeros_like(v))
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
        return acc * alpha[:, None] + pv, m_new, l * alpha + jnp.sum(p, axis=1)

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), -jnp.inf, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = lax.fori_loop(lo, hi, body, (acc, m, l))
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def _pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def unsupported_reason(q: jax.Array, k_cache: jax.Array) -> str | None:
    """Why this kernel cannot take these shapes, or None: Triton's power-of-two tensors, dots >= 16."""
    _, block_size, _, head_dim = k_cache.shape
    if not _pow2_at_least_16(block_size):
        return f"block_size {block_size} is not a power of two >= 16"
    if not _pow2_at_least_16(head_dim):
        return f"head_dim {head_dim} is not a power of two >= 16"
    if q.dtype != k_cache.dtype and not is_quantized_kv(k_cache.dtype):
        return f"q dtype {q.dtype} differs from cache dtype {k_cache.dtype}"
    if q.shape[1] % k_cache.shape[2]:
        return f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads"
    return None


def default_num_splits(num_items: int, num_kv_heads: int, target_programs: int = 256) -> int:
    """Flash-decoding split: enough programs to fill a GPU when the batch is small, 1 when large."""
    splits = max(1, target_programs // max(1, num_items * num_kv_heads))
    return min(16, 1 << (splits.bit_length() - 1))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "rows", "num_splits",
                     "num_warps", "num_stages", "interpret"),
)
def ragged_paged_attention_triton(
    q: jax.Array,              # [T, N, H]
    k_cache: jax.Array,        # [num_blocks, block_size, K, H]
    v_cache: jax.Array,        # [num_blocks, block_size, K, H]
    kv_lens: jax.Array,        # [S] int32
    block_tables: jax.Array,   # [S, W] int32
    cu_q_lens: jax.Array,      # [S + 1] int32
    num_seqs: jax.Array,       # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    rows: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if rows is None:   # decode-only buckets: small tiles; buckets with prefill rows: fewer KV re-reads
        rows = 16 if num_tokens <= kv_lens.shape[0] else 64
    reason = unsupported_reason(q, k_cache)
    if reason is not None or not _pow2_at_least_16(rows):
        raise ValueError(f"triton ragged paged attention: {reason or f'rows {rows} is not a power of two >= 16'}")
    num_items = wp.max_work_items(num_tokens, kv_lens.shape[0], group, rows)
    if num_splits is None:   # the interpreters' cost grows with programs: one split there
        num_splits = 1 if interpret else default_num_splits(num_items, num_kv_heads)

    meta, item_start = wp.plan_work(cu_q_lens, kv_lens, num_seqs, group=group, rows=rows,
                                    tile_keys=block_size, num_items=num_items,
                                    sliding_window=sliding_window)
    q_rows = wp.group_queries(q, num_kv_heads, rows)                      # [K, R, H]
    kernel = functools.partial(
        _kernel, rows=rows, group=group, block_size=block_size, num_splits=num_splits,
        sm_scale=float(sm_scale), sliding_window=sliding_window, soft_cap=soft_cap)
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_kv_heads, num_items, num_splits),
        in_specs=[whole(meta.shape), whole(block_tables.shape), whole(q_rows.shape),
                  whole(k_cache.shape), whole(v_cache.shape)],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda h, i, p: (p, i, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda h, i, p: (p, i, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, rows), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_triton",
    )(meta, block_tables.astype(jnp.int32), q_rows, k_cache, v_cache)
    merged = wp.combine_splits(out, lse)
    return wp.scatter_rows(merged, item_start, cu_q_lens, kv_lens, num_seqs,
                           num_tokens=num_tokens, group=group, dtype=q.dtype)

