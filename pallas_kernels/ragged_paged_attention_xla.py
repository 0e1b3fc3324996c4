"""Ragged paged attention in plain XLA, fast enough to serve from on the CPU.

The reference gathers every query's whole block table; this implementation instead walks the
context in chunks of `kv_chunk_blocks` blocks with an online softmax, so its cost follows the
longest live context in the batch (a data-dependent trip count), not the table's width, and it
materialises one small chunk at a time.

It needs one promise from the caller, `uniform_q_len=Q` (static): every sequence slot owns
exactly Q query rows, i.e. cu_q_lens[s] == s * Q. The runner packs decodes as Q = 1 and prefill
chunks as tiles of Q rows, each tile its own "sequence" whose kv_len is its last row's position
+ 1; rows of a tile past the real chunk sit at later positions and are discarded by the runner.
Then queries of one slot share their keys, and attention is a plain batched matmul per slot:
[Q*G, H] x [H, C] per KV head, which XLA:CPU runs well, with no key gathered twice per slot.
Without the promise it falls back to the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference


def ragged_paged_attention_xla(
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
    uniform_q_len: int | None = None,
    kv_chunk_blocks: int = 4,
) -> jax.Array:
    if uniform_q_len is None:
        return ragged_paged_attention_reference(
            q, k_cache, v_cache, kv_lens, block_tables, cu_q_lens, num_seqs,
            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)

    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    qlen = uniform_q_len
    slots = num_tokens // qlen
    if slots * qlen != num_tokens:
        raise ValueError(f"uniform_q_len={qlen} does not divide the {num_tokens} query rows")
    width = block_tables.shape[1]
    chunk_blocks = min(kv_chunk_blocks, width)
    chunk = chunk_blocks * block_size
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    live = jnp.arange(slots) < n                                           # [S]
    kv_lens = jnp.where(live, kv_lens[:slots], 0)
    # Pad the table so the last chunk's dynamic slice stays in range (null block 0 past the end).
    pad = (-width) % chunk_blocks
    tables = jnp.pad(block_tables[:slots], ((0, 0), (0, pad)))
    num_chunks = (jnp.max(kv_lens) + chunk - 1) // chunk

    # [S, K, Q*G, H]: rows of one slot and one KV head's query group form one matmul operand.
    qs = q.reshape(slots, qlen, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qs = qs.reshape(slots, num_kv_heads, qlen * group, head_dim).astype(jnp.float32) * sm_scale
    q_pos = kv_lens[:, None] - qlen + jnp.arange(qlen)[None, :]             # [S, Q]
    q_pos = jnp.repeat(q_pos, group, axis=1)                                # [S, Q*G] (row = q * G + g)

    def body(i, carry):
        m, l, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, i * chunk_blocks, chunk_blocks, axis=1)  # [S, Cb]
        # [S, Cb, bs, K, H] -> [S, K, C, H]
        k = k_cache[ids].reshape(slots, chunk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = v_cache[ids].reshape(slots, chunk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        s = jax.lax.dot_general(qs, k.astype(jnp.float32), (((3,), (3,)), ((0, 1), (0, 1))))  # [S, K, QG, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = i * chunk + jnp.arange(chunk)
        mask = key_pos[None, None, :] <= q_pos[:, :, None]                  # [S, QG, C]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        mask = mask[:, None]                                                # [S, 1, QG, C]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.exp(jnp.where(jnp.isfinite(m), m - m_safe, -jnp.inf))
        # Pages past a sequence's end may hold anything (tests fill them with NaN): mask V too.
        v = jnp.where(key_pos[None, None, :, None] < kv_lens[:, None, None, None], v.astype(jnp.float32), 0.0)
        pv = jax.lax.dot_general(p, v, (((3,), (2,)), ((0, 1), (0, 1))))   # [S, K, QG, H]
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (
        jnp.full((slots, num_kv_heads, qlen * group), -jnp.inf, jnp.float32),
        jnp.zeros((slots, num_kv_heads, qlen * group), jnp.float32),
        jnp.zeros((slots, num_kv_heads, qlen * group, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.where(live[:, None, None, None], out, 0.0)
    # [S, K, Q*G, H] -> [S*Q, N, H]
    out = out.reshape(slots, num_kv_heads, qlen, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
