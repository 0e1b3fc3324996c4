"""The XLA attention never makes XLA copy the KV arena, whatever the block table's width.

Issue 14's configuration cliff: with max_model_len=1024 a batch-1 decode step took 30x longer than
with 8192. A table that narrow put the whole work list in one loop window, XLA hoisted the K/V
gathers out of the loop, and the one-row KV write before them was then duplicated, each copy on
its own full copy of the arena: four arena-sized buffers per layer per step. The symptom is
visible without timing anything: the compiled step's temporary memory holds arena-sized buffers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.step import write_kv
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

NUM_BLOCKS, BLOCK, KV_HEADS, GROUP, HEAD_DIM = 4096, 16, 2, 3, 16
CHUNK_BLOCKS, PER_ITER = 8, 16          # the decode work granularity of jaxserve/runner/step.py
CACHE_BYTES = NUM_BLOCKS * BLOCK * KV_HEADS * HEAD_DIM * 4


def _layer(slots: int, qlen: int):
    """One layer of the step: write the new K/V rows into the donated caches, then attend."""
    def layer(caches, q, k, v, slot_mapping, kv_lens, tables, num):
        k_cache, v_cache = write_kv(caches[0], caches[1], k, v, slot_mapping)
        cu = jnp.arange(slots + 1, dtype=jnp.int32) * qlen
        out = ragged_paged_attention_xla(q, k_cache, v_cache, kv_lens, tables, cu, num, sm_scale=0.25,
                                         uniform_q_len=qlen, kv_chunk_blocks=CHUNK_BLOCKS,
                                         items_per_iter=PER_ITER)
        return (k_cache, v_cache), out
    return jax.jit(layer, donate_argnums=(0,))


def _temp_bytes(slots: int, qlen: int, width: int) -> int:
    rows = slots * qlen
    f32, i32 = jnp.float32, jnp.int32

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype)

    cache = spec((NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), f32)
    compiled = _layer(slots, qlen).lower(
        (cache, cache), spec((rows, KV_HEADS * GROUP, HEAD_DIM), f32), spec((rows, KV_HEADS, HEAD_DIM), f32),
        spec((rows, KV_HEADS, HEAD_DIM), f32), spec((rows,), i32), spec((slots,), i32),
        spec((slots, width), i32), spec((1,), i32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


# widths 1..128 fit one loop window of a single decode slot (<= 16 chunks of 8 blocks); 129 does not
@pytest.mark.parametrize("slots,qlen,width", [(1, 1, 9), (1, 1, 65), (1, 1, 128), (1, 1, 129), (1, 1, 513),
                                              (2, 1, 33), (1, 8, 9)])
def test_no_arena_sized_temporaries(slots, qlen, width):
    temp = _temp_bytes(slots, qlen, width)
    assert temp < CACHE_BYTES / 2, (
        f"{slots} slot(s) of {qlen} query row(s), table width {width}: {temp:,} bytes of temporaries, "
        f"against {CACHE_BYTES:,} for one layer's K cache: XLA is copying the arena")


def test_a_work_list_in_one_window_still_matches_the_reference():
    """The narrow-table case the fix is about, computed: one decode over 3 of a 4-wide table."""
    rng = np.random.default_rng(0)
    blocks, kv_len = 8, 3 * BLOCK - 5
    k, v = (jnp.asarray(rng.standard_normal((blocks, BLOCK, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in "kv")
    q = jnp.asarray(rng.standard_normal((1, KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
    args = (q, k, v, jnp.array([kv_len], jnp.int32), jnp.array([[5, 2, 7, 0]], jnp.int32),
            jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32))
    got = ragged_paged_attention_xla(*args, sm_scale=0.25, uniform_q_len=1, kv_chunk_blocks=CHUNK_BLOCKS,
                                     items_per_iter=PER_ITER)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
