"""Ragged paged attention in plain XLA, fast enough to serve from on the CPU.

The reference gathers every query's whole block table. This implementation does work in
proportion to the live context only: it cuts every live sequence's context into chunks of
`kv_chunk_blocks` blocks, lays the (sequence, chunk) pairs out as one flat work list (padding
slots and pages past a sequence's end contribute no items), and walks that list
`items_per_iter` items per loop iteration, a data-dependent trip count. Each item is a partial
softmax over its chunk (max, sum, weighted values, as in split-KV "flash decoding"); a segment
reduction per sequence combines the partials at the end. A batch of 22 decodes of 50..760 tokens
in 32 slots so costs what its 22 contexts cost, not 32 times the longest.

Each iteration derives its items from the loop counter (`_iteration_items`), so nothing in the
loop body is loop-invariant. An earlier version sliced each iteration's items out of work-list
arrays built before the loop. When the whole list fit one iteration (a lone decode over a table
of at most items_per_iter x kv_chunk_blocks blocks: max_model_len up to 2,032 with 16-token
blocks and 16-row prefill tiles), the slice was the whole array, XLA hoisted the K/V gathers out of the loop, and then
duplicated the step's one-row KV write (a dynamic-update-slice) for them, each duplicate on its
own copy of the layer's arena: the embedded model's batch-1 step held 1.6 GB of temporaries
(3.3 MB now) and decoded 30x slower at max_model_len=1024 than at 8192 (issue 14).

It needs one promise from the caller, `uniform_q_len=Q` (static): every sequence slot owns
exactly Q query rows, i.e. cu_q_lens[s] == s * Q. The runner packs decodes as Q = 1 and prefill
chunks as tiles of Q rows, each tile its own "sequence" whose kv_len is its last row's position
+ 1; rows of a tile past the real chunk sit at later positions and are discarded by the runner.
Then queries of one slot share their keys, and each item is a plain batched matmul,
[Q*G, H] x [H, C] per KV head, which XLA:CPU runs well. Without the promise it falls back to the
reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference

HIGHEST = jax.lax.Precision.HIGHEST   # float32 on a GPU too (its default is TF32); no-op on the CPU


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
    items_per_iter: int = 8,
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
    rows = qlen * group                         # query rows per (slot, KV head)
    width = block_tables.shape[1]
    chunk_blocks = min(kv_chunk_blocks, width)
    chunk = chunk_blocks * block_size
    max_chunks = -(-width // chunk_blocks)
    # Pad the table to whole chunks (null block 0 past the end).
    tables = jnp.pad(block_tables[:slots], ((0, 0), (0, max_chunks * chunk_blocks - width)))
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    live = jnp.arange(slots) < n                                            # [S]
    kv_lens = jnp.where(live, kv_lens[:slots], 0)

    # The work list: item i is chunk item_chunk[i] of slot item_slot[i], slots in order.
    first_chunk = jnp.zeros_like(kv_lens)
    if sliding_window is not None:                                          # skip chunks no query sees
        first_chunk = jnp.maximum(kv_lens - qlen - sliding_window + 1, 0) // chunk
    num_chunks = jnp.where(kv_lens > 0, (kv_lens + chunk - 1) // chunk - first_chunk, 0)
    ends = jnp.cumsum(num_chunks)
    num_items = ends[-1]
    per_iter = items_per_iter

    # [S, K, Q*G, H]: rows of one slot and one KV head's query group form one matmul operand.
    qs = q.reshape(slots, qlen, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qs = qs.reshape(slots, num_kv_heads, rows, head_dim).astype(jnp.float32) * sm_scale
    q_pos = kv_lens[:, None] - qlen + jnp.arange(qlen)[None, :]             # [S, Q]
    q_pos = jnp.repeat(q_pos, group, axis=1)                                # [S, Q*G] (row = q * G + g)

    def body(i, carry):
        m_run, l_run, acc_run = carry
        slot, chunk_id, valid = _iteration_items(i, per_iter, ends, num_chunks, first_chunk)   # [I] each
        ids = tables[slot[:, None], chunk_id[:, None] * chunk_blocks + jnp.arange(chunk_blocks)]  # [I, Cb]
        k = k_cache[ids].reshape(per_iter, chunk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = v_cache[ids].reshape(per_iter, chunk, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
        s = jax.lax.dot_general(qs[slot], k.astype(jnp.float32), (((3,), (3,)), ((0, 1), (0, 1))),
                                precision=HIGHEST)                               # [I, K, QG, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = chunk_id[:, None] * chunk + jnp.arange(chunk)                   # [I, C]
        pos = q_pos[slot]                                                        # [I, QG]
        mask = (key_pos[:, None, :] <= pos[:, :, None]) & valid[:, None, None]   # [I, QG, C]
        if sliding_window is not None:
            mask &= key_pos[:, None, :] > pos[:, :, None] - sliding_window
        mask = mask[:, None]
        s = jnp.where(mask, s, -jnp.inf)
        m_new = m_run.at[slot].max(s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.where(jnp.isfinite(m_run), jnp.exp(m_run - m_safe), 0.0)      # [S, K, QG]
        p = jnp.where(mask, jnp.exp(s - m_safe[slot][..., None]), 0.0)
        in_len = key_pos < kv_lens[slot][:, None]
        v = jnp.where(in_len[:, None, :, None], v.astype(jnp.float32), 0.0)
        pv = jax.lax.dot_general(p, v, (((3,), (2,)), ((0, 1), (0, 1))), precision=HIGHEST)  # [I, K, QG, H]
        l_run = (l_run * alpha).at[slot].add(p.sum(-1))
        acc_run = (acc_run * alpha[..., None]).at[slot].add(pv)
        return m_new, l_run, acc_run

    init = (
        jnp.full((slots, num_kv_heads, rows), -jnp.inf, jnp.float32),
        jnp.zeros((slots, num_kv_heads, rows), jnp.float32),
        jnp.zeros((slots, num_kv_heads, rows, head_dim), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, (num_items + per_iter - 1) // per_iter, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    out = jnp.where(live[:, None, None, None], out, 0.0)
    # [S, K, Q*G, H] -> [S*Q, N, H]
    out = out.reshape(slots, num_kv_heads, qlen, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _iteration_items(i, per_iter: int, ends, num_chunks, first_chunk):
    """Items [i * per_iter, (i + 1) * per_iter) of the work list: (slot, chunk, valid) of each.

    Computed from the loop counter inside the body, never sliced out of arrays built before the
    loop: a slice that can cover the whole array is loop-invariant, and XLA then hoists the K/V
    gathers out of the loop (see the module docstring).
    """
    slots = ends.shape[0]
    item = i * per_iter + jnp.arange(per_iter)
    # searchsorted by comparing against all `slots` ends: no nested loop in the body
    slot = jnp.minimum(jnp.searchsorted(ends, item, side="right", method="compare_all"), slots - 1)
    slot = slot.astype(jnp.int32)
    valid = item < ends[-1]
    chunk_id = jnp.where(valid, item - ends[slot] + num_chunks[slot] + first_chunk[slot], 0)
    return slot, chunk_id, valid
