"""Ragged paged attention for Hopper (sm90+) GPUs, as a Mosaic GPU kernel (`plgpu.kernel`).

One CUDA block per (KV head, work item, split) (see `work_plan`), one warpgroup each:
  1. one bulk copy brings the item's metadata and its sequence's block table into SMEM;
  2. a bulk copy brings the item's 64 query rows (the KV head's query group, tokens x heads);
  3. the loop over the item's KV tiles (64 keys each, gathered page by page from the block table
     with one bulk copy per page) runs `num_stages` tiles ahead, so copies overlap the math;
  4. per tile: S = Q K^T on wgmma, masking and online softmax in registers (float32), P staged
     in SMEM as the left operand of the second wgmma, acc = acc * alpha + P V;
  5. the tile's normalised output and log-sum-exp go out through SMEM with bulk copies, and
     `work_plan.combine_splits` merges the flash-decoding splits in XLA.
Caches must be 16-bit (bf16 or f16): wgmma takes float32 only as tf32 and only K-major, which
P V is not; float32 caches go to the Triton kernel (see `dispatch`). Head dims are multiples of
64 or 128 (a 128-byte swizzle row; 256 would not fit 3 stages in SMEM); a cache block holds
8..64 tokens dividing 64, or a multiple of 64 (a tile is then a 64-row slice of one page).

Slots past a sequence's length may hold anything (stale values, NaN in tests): K there is
masked before the softmax, and V rows there are zeroed in SMEM on the one tile that holds them,
because 0 * NaN would still poison P V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import work_plan as wp

ROWS = 64        # query rows per item: the wgmma M dimension
ITEM_ROW = 128   # int32 per SMEM row of an item's metadata + block table (bulk copies move <= 256 per dim)
OUT_ROWS = 8     # output rows per bulk copy
TILE_KEYS = 64   # keys per pipeline step: a 128-byte swizzled row of P in 16 bits; a tile is
                 # 64 / block_size whole pages, or a 64-row slice of a larger page


def unsupported_reason(q: jax.Array, k_cache: jax.Array) -> str | None:
    """Why this kernel cannot take these shapes, or None."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if jnp.dtype(k_cache.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cache dtype {k_cache.dtype} is not bf16/f16 (wgmma's f32 is tf32, K-major only)"
    if q.dtype != k_cache.dtype:
        return f"q dtype {q.dtype} differs from cache dtype {k_cache.dtype}"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} is not 64 or 128 (SMEM holds 3 stages of 64 x 128 K/V tiles)"
    if block_size % 8 or (block_size < TILE_KEYS and TILE_KEYS % block_size) or (
            block_size > TILE_KEYS and block_size % TILE_KEYS):
        return f"block_size {block_size} must be 8..64 dividing 64, or a multiple of 64"
    if q.shape[1] % num_kv_heads:
        return f"{q.shape[1]} query heads are not a multiple of {num_kv_heads} KV heads"
    return None


def _transforms(dtype):
    swizzle = 128
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _kernel(items_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
            items_smem, q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem,
            items_bar, q_bar, k_bars, v_bars, *,
            group, block_size, tile_keys, num_stages, num_splits, sm_scale, sliding_window,
            soft_cap):
    # items_ref [W, C, ITEM_ROW] int32: metadata, then the block table; q_ref [K, R, H];
    # k_ref, v_ref [num_blocks, block_size, K, H]; o_ref [P, W, K, ROWS, H] f32; lse_ref [P, W, K, ROWS] f32
    kh = lax.axis_index("kv_head")
    item = lax.axis_index("item")
    split = lax.axis_index("split")
    head_dim = q_ref.shape[-1]
    pages_per_tile = max(1, tile_keys // block_size)
    dtype = q_ref.dtype

    plgpu.copy_gmem_to_smem(items_ref.at[item], items_smem, items_bar)
    plgpu.barrier_wait(items_bar)

    def entry(i):   # field i of the item's row: metadata, then the block table
        return items_smem[i // ITEM_ROW, i % ITEM_ROW]

    @pl.when(entry(wp.VALID) != 0)
    def _():
        row0 = entry(wp.ROW0)
        lrow0 = entry(wp.LROW0)
        kv_len = entry(wp.KV_LEN)
        q_len = entry(wp.Q_LEN)
        lo, hi = wp.split_range(entry(wp.TILE_LO), entry(wp.TILE_HI), split, num_splits)

        plgpu.copy_gmem_to_smem(q_ref.at[kh, pl.ds(row0, ROWS)], q_smem, q_bar)

        def fetch(tile, slot):
            for i in range(pages_per_tile):           # one bulk copy per page (or page slice)
                if block_size <= tile_keys:
                    block = entry(wp.META_WIDTH + tile * pages_per_tile + i)
                    rows, offset = block_size, 0
                else:
                    block = entry(wp.META_WIDTH + tile * tile_keys // block_size)
                    rows, offset = tile_keys, lax.rem(tile * tile_keys, block_size)
                for src, dst, bars in ((k_ref, k_smem, k_bars), (v_ref, v_smem, v_bars)):
                    plgpu.copy_gmem_to_smem(
                        src.at[block, pl.ds(offset, rows), kh],
                        dst.at[slot, pl.ds(i * rows, rows)],
                        bars.at[slot])

        for s in range(num_stages):
            @pl.when(lo + s < hi)
            def _():
                fetch(lo + s, s)

        plgpu.barrier_wait(q_bar)
        # Rows past the item's end belong to the next item; clamping keeps their softmax finite.
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS, tile_keys), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (ROWS, tile_keys), 1, layout=plgpu.Layout.WGMMA)
        token = jnp.minimum((lrow0 + row) // group, q_len - 1)
        q_pos = kv_len - q_len + token                                    # [ROWS, tile_keys]

        def step(tile, carry):
            acc, m, l = carry
            slot = lax.rem(tile - lo, num_stages)
            plgpu.barrier_wait(k_bars.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((ROWS, tile_keys), jnp.float32)) * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key = tile * tile_keys + col
            ok = key <= q_pos
            if sliding_window is not None:
                ok &= key > q_pos - sliding_window
            s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)            # fully masked so far
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bars.at[slot])

            @pl.when((tile + 1) * tile_keys > kv_len)
            def _():
                # The tile holding the sequence's end: zero V past it (0 * NaN is NaN).
                v_row = plgpu.broadcasted_iota(jnp.int32, (tile_keys, head_dim), 0,
                                               layout=plgpu.Layout.WGMMA)
                v_tile = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
                v_smem.at[slot][...] = jnp.where(tile * tile_keys + v_row < kv_len, v_tile,
                                                 jnp.zeros_like(v_tile))
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]
            pv_out = pl.run_scoped(pv, plgpu.ACC((ROWS, head_dim), jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_out

            @pl.when(tile + num_stages < hi)
            def _():
                fetch(tile + num_stages, slot)               # the slot is free: both wgmmas done
            return acc, m_new, l

        acc = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc, m, l = lax.fori_loop(lo, hi, step, (acc, m, l))

        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o_smem[...] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        lse_smem[...] = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)
        plgpu.commit_smem()
        # Only the item's rows go out, 8 at a time: a decode's G rows cost one 8-row copy, not 64
        # (with many splits the output would otherwise rival the KV bytes of a short context).
        nrows = entry(wp.NROWS)
        for c in range(ROWS // OUT_ROWS):
            @pl.when(c * OUT_ROWS < nrows)     # (copy predicates do not run in the interpreter)
            def _():
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(c * OUT_ROWS, OUT_ROWS)],
                                        o_ref.at[split, item, kh, pl.ds(c * OUT_ROWS, OUT_ROWS)])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, item, kh])
        plgpu.wait_smem_to_gmem(0)


def default_num_splits(num_items: int, num_kv_heads: int, target_blocks: int = 264) -> int:
    """Flash-decoding split: about two CUDA blocks per SM of an H100/H200 (132 SMs) when the batch is small."""
    splits = max(1, target_blocks // max(1, num_items * num_kv_heads))
    return min(16, 1 << (splits.bit_length() - 1))


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "num_splits", "num_stages",
                     "interpret"),
)
def ragged_paged_attention_mosaic(
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
    num_splits: int | None = None,
    num_stages: int = 3,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """Same semantics as `ragged_paged_attention_reference`; [T, N, H] in q's dtype.

    `interpret` runs the Mosaic GPU interpreter on the CPU (True, or InterpretGPUParams, e.g. with
    detect_races=True); `num_splits` defaults to enough CUDA blocks for a small batch to fill an H200.
    """
    reason = unsupported_reason(q, k_cache)
    if reason is not None:
        raise ValueError(f"mosaic ragged paged attention: {reason}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tile_keys = TILE_KEYS
    num_items = wp.max_work_items(num_tokens, kv_lens.shape[0], group, ROWS)
    if num_splits is None:   # the interpreters' cost grows with programs: one split there
        num_splits = 1 if interpret else default_num_splits(num_items, num_kv_heads)

    meta, item_start = wp.plan_work(cu_q_lens, kv_lens, num_seqs, group=group, rows=ROWS,
                                    tile_keys=tile_keys, num_items=num_items,
                                    sliding_window=sliding_window)
    # Each item carries its sequence's block table, padded so the last tile's pages stay in
    # bounds (they point at the null block and are masked), folded into rows of ITEM_ROW.
    pages_per_tile = max(1, tile_keys // block_size)
    item_rows = wp.cdiv(wp.META_WIDTH + block_tables.shape[1] + pages_per_tile, ITEM_ROW)
    width = item_rows * ITEM_ROW - wp.META_WIDTH
    tables = jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, width - block_tables.shape[1])))[meta[:, wp.SEQ]]
    items = jnp.concatenate([meta, tables], axis=1).reshape(num_items, item_rows, ITEM_ROW)
    q_rows = wp.group_queries(q, num_kv_heads, ROWS)                     # [K, R, H]

    kernel = functools.partial(
        _kernel, group=group, block_size=block_size, tile_keys=tile_keys, num_stages=num_stages,
        num_splits=num_splits, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=soft_cap)
    tf = _transforms(q.dtype)
    out, lse = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, ROWS, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, num_items, num_kv_heads, ROWS), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((item_rows, ITEM_ROW), jnp.int32),
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=tf),
            plgpu.SMEM((num_stages, tile_keys, head_dim), q.dtype, transforms=tf),
            plgpu.SMEM((num_stages, tile_keys, head_dim), q.dtype, transforms=tf),
            plgpu.SMEM((ROWS, tile_keys), q.dtype, transforms=tf),
            plgpu.SMEM((ROWS, head_dim), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=num_stages),
            plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=num_stages),
        ),
        grid=(num_kv_heads, num_items, num_splits),
        grid_names=("kv_head", "item", "split"),
        # Lane semantics: explicit register layouts (WGMMA), the mature path in jax 0.11.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )(items, q_rows, k_cache, v_cache)
    merged = wp.combine_splits(out, lse)
    return wp.scatter_rows(merged, item_start, cu_q_lens, kv_lens, num_seqs,
                           num_tokens=num_tokens, group=group, dtype=q.dtype)
