"""Batch-invariant paged attention: a query's output depends on its own keys only, never on how
its step was packed.

The serving attention (pallas_kernels/ragged_paged_attention_xla.py) splits the work by what the
step holds: a prefill tile's queries share one matmul whose row count is the tile's, a sequence's
context is cut into chunks that depend on the bucket, and the replay's dense attention is one
softmax over the whole sequence. Each reduces in its own order, so a token's attention output
differs in its last bits between a decode, a prefill chunk and the trainer's replay. Here every
query goes through one fixed program:
- queries come in groups of GROUP_ROWS rows that share a block table (a decode is a group of one
  real row and padding; a prefill tile is split into groups; the replay groups its sequence's
  positions the same way), so every score matmul is [GROUP_ROWS * G, H] x [H, chunk] per KV head,
  whatever the step;
- keys are read in chunks of CHUNK_BLOCKS blocks at fixed absolute positions (chunk j holds
  positions [j * chunk, (j + 1) * chunk)), in order, with an online softmax. A chunk the query
  cannot see is an exact no-op (its running max stays, the rescale is exp(0) = 1, it adds 0), so
  the chunks a longer table or a longer neighbour adds change nothing, bit for bit;
- the loop runs per group until its last row's keys are read, one group after another through
  batch_invariant.fixed_map (a vmap's arithmetic changes with the number of groups).
Used by the engine's steps in the batch-invariant mode (runner/step.py) and by the replay
(jaxserve/replay.py) in the same mode, so both compute a token's logprob with the same arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models import batch_invariant
from jaxserve.models.config import ModelConfig

GROUP_ROWS = 8        # query rows per group: a multiple of the float32 vector width
CHUNK_BLOCKS = 8      # KV blocks per loop iteration (128 positions with 16-token blocks)


def grouped_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, tables: jax.Array,
                      limits: jax.Array, *, sm_scale: float, sliding_window: int | None = None,
                      soft_cap: float | None = None) -> jax.Array:
    """q [Gn, GROUP_ROWS, N, H]; k_cache, v_cache [num_blocks, block_size, K, H]; tables [Gn, W]
    block ids (a group's sequence); limits [Gn, GROUP_ROWS] int32: how many positions each row
    sees (its position + 1; 0 for a padding row, whose output is 0). Returns [Gn, GROUP_ROWS, N, H]
    in q's dtype."""
    groups, rows, num_heads, head_dim = q.shape
    if rows != GROUP_ROWS:
        raise ValueError(f"groups of {rows} rows; the batch-invariant attention takes {GROUP_ROWS}")
    _, block_size, num_kv_heads, _ = k_cache.shape
    g = num_heads // num_kv_heads
    chunk = CHUNK_BLOCKS * block_size
    width = -(-tables.shape[1] // CHUNK_BLOCKS) * CHUNK_BLOCKS
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))        # null block 0 past the end
    # [Gn, K, R*G, H]: row r's query heads for KV head k are rows r*G .. r*G + G - 1
    qs = q.reshape(groups, rows, num_kv_heads, g, head_dim).transpose(0, 2, 1, 3, 4)
    qs = qs.reshape(groups, num_kv_heads, rows * g, head_dim).astype(jnp.float32) * sm_scale
    q_pos = jnp.repeat(limits - 1, g, axis=1)                               # [Gn, R*G]

    def one_group(qg, table, pos, limit):
        # qg [K, RG, H], table [W], pos [RG], limit [R]
        last = jnp.max(limit)
        first = 0
        if sliding_window is not None:       # chunks no row of the group sees are skipped
            seen = jnp.where(limit > 0, limit - sliding_window, last)
            first = jnp.maximum(jnp.min(seen), 0) // chunk
        num_chunks = (last + chunk - 1) // chunk

        def body(carry):
            j, m_run, l_run, acc = carry
            ids = jax.lax.dynamic_slice(table, (j * CHUNK_BLOCKS,), (CHUNK_BLOCKS,))
            k = k_cache[ids].reshape(chunk, num_kv_heads, head_dim).transpose(1, 0, 2).astype(jnp.float32)
            v = v_cache[ids].reshape(chunk, num_kv_heads, head_dim).transpose(1, 0, 2).astype(jnp.float32)
            s = jax.lax.dot_general(qg, k, (((2,), (2,)), ((0,), (0,))),
                                    precision=jax.lax.Precision.HIGHEST)                # [K, RG, C]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            key_pos = j * chunk + jnp.arange(chunk)
            visible = key_pos[None, :] <= pos[:, None]                                   # [RG, C]
            if sliding_window is not None:
                visible &= key_pos[None, :] > pos[:, None] - sliding_window
            s = jnp.where(visible[None], s, -jnp.inf)
            m_new = jnp.maximum(m_run, s.max(-1))                                        # [K, RG]
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha = jnp.where(jnp.isfinite(m_run), jnp.exp(m_run - m_safe), 0.0)
            p = jnp.where(visible[None], jnp.exp(s - m_safe[..., None]), 0.0)
            pv = jax.lax.dot_general(p, v, (((2,), (1,)), ((0,), (0,))),
                                     precision=jax.lax.Precision.HIGHEST)               # [K, RG, H]
            return j + 1, m_new, l_run * alpha + p.sum(-1), acc * alpha[..., None] + pv

        init = (jnp.asarray(first, jnp.int32),
                jnp.full((num_kv_heads, rows * g), -jnp.inf, jnp.float32),
                jnp.zeros((num_kv_heads, rows * g), jnp.float32),
                jnp.zeros((num_kv_heads, rows * g, head_dim), jnp.float32))
        _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < num_chunks, body, init)
        return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)

    out = batch_invariant.fixed_map(one_group, qs, tables, q_pos, limits)  # [Gn, K, RG, H]
    out = out.reshape(groups, num_kv_heads, rows, g, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(groups, rows, num_heads, head_dim).astype(q.dtype)


def tiles_to_groups(q: jax.Array, tables: jax.Array, limits: jax.Array):
    """Tiles of Q rows sharing a table (q [S, Q, N, H], tables [S, W], limits [S, Q]) as groups of
    GROUP_ROWS rows: each tile padded to a multiple of GROUP_ROWS (padding rows see nothing) and
    split. Returns (q, tables, limits) in grouped_attention's shapes."""
    slots, qlen = q.shape[:2]
    per = -(-qlen // GROUP_ROWS)                                           # groups per tile
    pad = per * GROUP_ROWS - qlen
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(slots * per, GROUP_ROWS, *q.shape[2:])
    limits = jnp.pad(limits, ((0, 0), (0, pad))).reshape(slots * per, GROUP_ROWS)
    return q, jnp.repeat(tables, per, axis=0), limits


def groups_to_tiles(out: jax.Array, slots: int, qlen: int) -> jax.Array:
    """grouped_attention's output for tiles_to_groups' groups -> [S * Q, N, H] rows in tile order."""
    return out.reshape(slots, -1, *out.shape[2:])[:, :qlen].reshape(slots * qlen, *out.shape[2:])


def sequence_attention(config: ModelConfig, block_size: int = 16):
    """The replay's attention in the batch-invariant mode: the T tokens are ONE sequence at
    positions 0..T-1 (dense_causal_attention's contract), laid out in blocks of `block_size` as
    the engine's arena holds them and attended through grouped_attention, so each position's
    output equals the engine's for the same tokens, bit for bit. No cache is kept."""

    def attention(layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array, kv_cache):
        layer = config.layer_attention(layer_idx)
        t = q.shape[0]
        num_blocks = -(-t // block_size)
        width = -(-num_blocks // CHUNK_BLOCKS) * CHUNK_BLOCKS

        def blocks(x):    # [T, K, H] -> [width, block_size, K, H], zero blocks past the end
            x = jnp.pad(x, ((0, width * block_size - t), (0, 0), (0, 0)))
            return x.reshape(width, block_size, *x.shape[1:])

        table = jnp.arange(width, dtype=jnp.int32)[None]                       # one tile: the sequence
        limits = jnp.arange(1, t + 1, dtype=jnp.int32)[None]
        qg, tables, lims = tiles_to_groups(q[None], table, limits)
        out = grouped_attention(qg, blocks(k), blocks(v), tables, lims, sm_scale=layer.sm_scale,
                                sliding_window=layer.sliding_window, soft_cap=layer.soft_cap)
        return groups_to_tiles(out, 1, t), kv_cache

    return attention
