"""The reference against a naive per-sequence attention in numpy, written from the docstring alone."""

import numpy as np
import pytest

from pallas_kernel_cases import Case, make_inputs, with_options
from pallas_kernels import ragged_paged_attention_reference


def naive(inputs) -> np.ndarray:
    """Per sequence, per head: gather the context through the block table, causal softmax in float64."""
    q = np.asarray(inputs["q"], np.float64)
    k_cache = np.asarray(inputs["k_cache"], np.float64)
    v_cache = np.asarray(inputs["v_cache"], np.float64)
    kv_lens, tables, cu = (np.asarray(inputs[n]) for n in ("kv_lens", "block_tables", "cu_q_lens"))
    window, cap, scale = inputs["sliding_window"], inputs["soft_cap"], inputs["sm_scale"]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(inputs["num_seqs"][0])):
        n_ctx, q_len = kv_lens[s], cu[s + 1] - cu[s]
        slots = [(tables[s, p // block_size], p % block_size) for p in range(n_ctx)]
        k = np.stack([k_cache[b, o] for b, o in slots])          # [L, K, H]
        v = np.stack([v_cache[b, o] for b, o in slots])
        for i in range(q_len):
            pos = n_ctx - q_len + i
            keys = np.arange(n_ctx)
            visible = (keys <= pos) & ((keys > pos - window) if window else True)
            for h in range(q.shape[1]):
                scores = k[visible, h // group] @ q[cu[s] + i, h] * scale
                if cap:
                    scores = cap * np.tanh(scores / cap)
                p = np.exp(scores - scores.max())
                out[cu[s] + i, h] = (p / p.sum()) @ v[visible, h // group]
    return out


@pytest.mark.parametrize("c", [
    Case(q_lens=(1, 1, 1), kv_lens=(1, 16, 40), group=1),
    Case(q_lens=(7, 1, 5), kv_lens=(7, 64, 21), group=3, num_tokens=16),
    Case(q_lens=(4, 9), kv_lens=(50, 9), group=4, sliding_window=6, seed=2),
    Case(q_lens=(2, 3), kv_lens=(33, 3), group=8, head_dim=128, soft_cap=2.0, seed=3),
    with_options(Case(q_lens=(3, 1), kv_lens=(3, 17), group=2), block_size=8, width=4, num_blocks=8),
], ids=lambda c: c.label())
def test_reference_matches_naive_per_sequence_attention(c):
    inputs = make_inputs(c)
    got = np.asarray(ragged_paged_attention_reference(**inputs))
    want = naive(inputs)
    n = sum(c.q_lens)
    np.testing.assert_allclose(got[:n], want[:n], atol=2e-5, rtol=2e-5)
    assert np.all(got[n:] == 0), "padding query rows come out as zeros"
