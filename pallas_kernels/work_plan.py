"""Cuts a ragged batch into fixed-size work items for the GPU kernels, and puts their results back.

The GPU kernels see queries as rows: row `t * G + j` is token t's query head `k * G + j` for KV
head k (G query heads per KV head). Grouping the G heads of one KV head into rows lets one matmul
serve the whole group while the KV head is read once, and makes the matmul's M dimension a
power of two whatever G is (3 included). A work item is a tile of `rows` consecutive rows of ONE
sequence: a decode is one item, a prefill chunk of n tokens is cdiv(n * G, rows) items. Items never
straddle sequences, so a kernel program needs one block table and one length.

The number of items depends on the data, the grid cannot: the grid has `max_work_items` items and
the ones past the real count are marked invalid (the kernels skip them). Each item also carries
the range of KV tiles (`tile_keys` keys each) it must visit: causality ends it at the item's last
query, a sliding window starts it late. A flash-decoding split divides that range among
`num_splits` programs, whose partial results `combine_splits` merges with their log-sum-exps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import query_layout

# int32 fields per item; a row is padded to 32 fields so it is one 128-byte bulk copy.
META_WIDTH = 32
SEQ, ROW0, LROW0, NROWS, KV_LEN, Q_LEN, TILE_LO, TILE_HI, VALID = range(9)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_work_items(num_tokens: int, max_num_seqs: int, group: int, rows: int) -> int:
    """Upper bound on the items of any batch with these static shapes (each seq adds <= 1 partial tile)."""
    return max(1, min(cdiv(num_tokens * group, rows) + max_num_seqs, num_tokens * group))


def group_queries(q: jax.Array, num_kv_heads: int, rows: int) -> jax.Array:
    """q [T, N, H] -> [K, T * G + rows, H]: row t * G + j is head k * G + j of token t.

    `rows` extra zero rows at the end keep every item's tile in bounds.
    """
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    qr = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    qr = qr.reshape(num_kv_heads, num_tokens * group, head_dim)
    return jnp.pad(qr, ((0, 0), (0, rows), (0, 0)))


def plan_work(
    cu_q_lens: jax.Array,     # [S + 1] int32
    kv_lens: jax.Array,       # [S] int32
    num_seqs: jax.Array,      # [1] int32
    *,
    group: int,
    rows: int,
    tile_keys: int,
    num_items: int,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (meta [num_items, META_WIDTH] int32, item_start [S] int32: first item of each seq)."""
    max_seqs = kv_lens.shape[0]
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).astype(jnp.int32)               # [S]
    live = jnp.arange(max_seqs, dtype=jnp.int32) < n
    items_per_seq = jnp.where(live, (q_lens * group + rows - 1) // rows, 0)   # [S]
    item_end = jnp.cumsum(items_per_seq).astype(jnp.int32)                     # [S]
    item_start = item_end - items_per_seq

    i = jnp.arange(num_items, dtype=jnp.int32)
    valid = i < item_end[-1]
    seq = jnp.clip(jnp.searchsorted(item_end, i, side="right"), 0, max_seqs - 1).astype(jnp.int32)
    q_len = q_lens[seq]
    kv_len = kv_lens[seq].astype(jnp.int32)
    lrow0 = (i - item_start[seq]) * rows                   # first row of the item within its seq
    nrows = jnp.clip(q_len * group - lrow0, 0, rows)
    row0 = cu_q_lens[seq].astype(jnp.int32) * group + lrow0
    pos_lo = kv_len - q_len + lrow0 // group               # positions of the item's first and
    pos_hi = kv_len - q_len + (lrow0 + nrows - 1) // group  # last query token
    key_lo = jnp.zeros_like(pos_lo) if sliding_window is None else pos_lo - sliding_window + 1
    tile_lo = jnp.maximum(key_lo, 0) // tile_keys
    tile_hi = (pos_hi + tile_keys) // tile_keys            # cdiv(pos_hi + 1, tile_keys)
    tile_lo = jnp.where(valid, tile_lo, 0)
    tile_hi = jnp.where(valid, tile_hi, 0)
    fields = [seq, row0, lrow0, nrows, kv_len, q_len, tile_lo, tile_hi, valid.astype(jnp.int32)]
    fields = [jnp.where(valid, f, 0) for f in fields]
    meta = jnp.stack(fields, axis=1).astype(jnp.int32)
    meta = jnp.pad(meta, ((0, 0), (0, META_WIDTH - meta.shape[1])))
    return meta, item_start


def split_range(tile_lo, tile_hi, split, num_splits: int):
    """Tiles [a, b) of split `split` out of `num_splits` equal shares of [tile_lo, tile_hi)."""
    chunk = (tile_hi - tile_lo + num_splits - 1) // num_splits
    a = tile_lo + split * chunk
    b = jnp.minimum(a + chunk, tile_hi)
    return a, b


def combine_splits(
    out: jax.Array,   # [P, W, K, rows, H] float32, each split normalised by its own sum
    lse: jax.Array,   # [P, W, K, rows] float32, -inf where a split saw no key
) -> jax.Array:
    """Merges flash-decoding splits: weights each split by exp(lse_p - logsumexp(lse)). [W, K, rows, H]"""
    if out.shape[0] == 1:
        return out[0]
    top = jnp.max(lse, axis=0)                                     # [W, K, rows]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - top[None])                                   # [P, W, K, rows]; 0 for empty
    total = jnp.sum(w, axis=0)
    merged = jnp.sum(w[..., None] * out, axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def scatter_rows(
    out: jax.Array,          # [W, K, rows, H] float32
    item_start: jax.Array,   # [S] int32
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    num_tokens: int,
    group: int,
    dtype,
) -> jax.Array:
    """Item tiles back to packed query order [T, N, H]; padding query rows are zeros."""
    num_items, num_kv_heads, rows, head_dim = out.shape
    seq_ids, _, valid = query_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    lrow = (t - cu_q_lens[seq_ids])[:, None] * group + jnp.arange(group, dtype=jnp.int32)[None, :]
    item = jnp.clip(item_start[seq_ids][:, None] + lrow // rows, 0, num_items - 1)   # [T, G]
    pos = lrow % rows                                                                 # [T, G]
    k = jnp.arange(num_kv_heads, dtype=jnp.int32)
    gathered = out[item[:, :, None], k[None, None, :], pos[:, :, None]]               # [T, G, K, H]
    gathered = gathered.transpose(0, 2, 1, 3).reshape(num_tokens, num_kv_heads * group, head_dim)
    return jnp.where(valid[:, None, None], gathered, 0.0).astype(dtype)
