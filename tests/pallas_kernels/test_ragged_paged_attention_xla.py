"""The XLA implementation equals the reference on the uniform layouts the runner packs."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla

BLOCK = 4


def make_case(rng, *, slots, live, qlen, num_kv_heads, group, head_dim, width, kv_lens):
    num_blocks = slots * width + 3
    k = rng.standard_normal((num_blocks, BLOCK, num_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_blocks, BLOCK, num_kv_heads, head_dim)).astype(np.float32)
    # Non-contiguous tables drawn from a shuffled pool; every unused page is NaN, so a stray
    # read of a page no sequence owns poisons the output.
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((slots, width), np.int32)
    used = set()
    for s in range(live):
        need = -(-kv_lens[s] // BLOCK)
        tables[s, :need] = perm[s * width: s * width + need]
        used.update(tables[s, :need].tolist())
    for b in range(num_blocks):
        if b not in used:
            k[b] = np.nan
            v[b] = np.nan
    # Within the last used block, slots past kv_len are NaN too.
    for s in range(live):
        last, off = divmod(kv_lens[s], BLOCK)
        if off:
            k[tables[s, last], off:] = np.nan
            v[tables[s, last], off:] = np.nan
    q = rng.standard_normal((slots * qlen, num_kv_heads * group, head_dim)).astype(np.float32)
    lens = np.zeros(slots, np.int32)
    lens[:live] = kv_lens
    cu = np.arange(slots + 1, dtype=np.int32) * qlen
    return [jnp.asarray(x) for x in (q, k, v, lens, tables, cu, np.array([live], np.int32))]


@pytest.mark.parametrize("qlen,group,window", [(1, 3, None), (1, 1, None), (8, 3, None), (8, 4, 5), (3, 2, None),
                                               (1, 3, 6)])
@pytest.mark.parametrize("chunk_blocks,per_iter", [(2, 3), (1, 1), (3, 8)])
def test_xla_matches_reference_on_uniform_slots(qlen, group, window, chunk_blocks, per_iter):
    rng = np.random.default_rng(qlen * 10 + group)
    slots, live, width = 6, 4, 7
    kv_lens = [max(qlen, x) for x in (1, BLOCK, 2 * BLOCK + 1, width * BLOCK)]
    args = make_case(rng, slots=slots, live=live, qlen=qlen, num_kv_heads=2, group=group,
                     head_dim=16, width=width, kv_lens=kv_lens)
    ref = ragged_paged_attention_reference(*args, sm_scale=0.25, sliding_window=window)
    got = ragged_paged_attention_xla(*args, sm_scale=0.25, sliding_window=window, uniform_q_len=qlen,
                                     kv_chunk_blocks=chunk_blocks, items_per_iter=per_iter)
    ref, got = np.asarray(ref), np.asarray(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert np.all(got[live * qlen:] == 0)   # padding slots come out as zeros


def test_xla_without_the_promise_is_the_reference():
    rng = np.random.default_rng(0)
    args = make_case(rng, slots=3, live=3, qlen=2, num_kv_heads=1, group=2, head_dim=8, width=3,
                     kv_lens=[2, 5, 9])
    ref = ragged_paged_attention_reference(*args, sm_scale=0.3)
    got = ragged_paged_attention_xla(*args, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-6)
