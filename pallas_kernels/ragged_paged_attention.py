"""Ragged paged attention: the signature every implementation shares, and its pure-JAX reference.

In one engine step the batch is ragged: each sequence brings some new query tokens (1 for a
decode, up to a chunk for a prefill) packed one after another into `q`, and attends causally to
its whole context, which lives in the paged KV cache (already holding the new tokens' K/V, since
the model writes them before calling attention).

Layout, shared by every implementation and by the runner that allocates the cache:
  q            [T, N, H]                    packed queries of all sequences (T tokens)
  k_cache      [num_blocks, block_size, K, H]   one layer's keys
  v_cache      [num_blocks, block_size, K, H]   one layer's values
  kv_lens      [S] int32    context length of each sequence, new tokens included
  block_tables [S, W] int32 logical block j of sequence s lives in physical block block_tables[s, j]
  cu_q_lens    [S + 1] int32  queries of sequence s are q[cu_q_lens[s]:cu_q_lens[s + 1]]
  num_seqs     [1] int32    sequences in use; rows >= num_seqs are padding
Query i of sequence s sits at position kv_lens[s] - q_len[s] + i and sees keys 0..that position
(within `sliding_window` of it, when set). Padding query rows (beyond cu_q_lens[num_seqs])
come out as zeros. Accumulation is float32 whatever the input dtype.

This reference gathers each token's whole block table: simple enough to trust, too slow to serve
with. It is the source of truth for the kernels and the XLA implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def query_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """For each packed query row: its sequence index, its position, and whether it is real.

    Returns (seq_ids [T] int32, q_pos [T] int32, valid [T] bool).
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    # seq s owns rows [cu[s], cu[s+1]); searchsorted(side=right) - 1 finds s for row t.
    seq_ids = jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1
    seq_ids = jnp.clip(seq_ids, 0, kv_lens.shape[0] - 1)
    valid = (t < cu_q_lens[n]) & (seq_ids < n)
    q_len = cu_q_lens[seq_ids + 1] - cu_q_lens[seq_ids]
    q_pos = kv_lens[seq_ids] - q_len + (t - cu_q_lens[seq_ids])
    return seq_ids, q_pos, valid


def ragged_paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]

    seq_ids, q_pos, valid = query_layout(cu_q_lens, kv_lens, num_seqs, num_tokens)
    tables = block_tables[seq_ids]                                   # [T, W]
    # [T, W, block_size, K, H] -> [T, L, K, H] with L = W * block_size
    k = k_cache[tables].reshape(num_tokens, width * block_size, num_kv_heads, head_dim)
    v = v_cache[tables].reshape(num_tokens, width * block_size, num_kv_heads, head_dim)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    # HIGHEST: on a GPU the default precision of a float32 dot is TF32, not the float32 the
    # reference promises (a no-op on the CPU).
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("tkgh,tlkh->tkgl", qg, k.astype(jnp.float32), precision=hi) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(width * block_size, dtype=jnp.int32)
    mask = key_pos[None, :] <= q_pos[:, None]                         # [T, L]
    if sliding_window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - sliding_window
    mask &= valid[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    # A padding row masks everything; keep it finite so it yields zeros, not NaN.
    scores = jnp.where(valid[:, None, None, None], scores, 0.0)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)
    # Unused pages may hold garbage (tests fill them with NaN): never multiply them in.
    v = jnp.where(mask[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("tkgl,tlkh->tkgh", probs, v, precision=hi)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
