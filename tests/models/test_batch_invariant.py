"""The batch-invariant mode's kernels (models/batch_invariant.py, models/invariant_attention.py):
a row's bits do not depend on how many rows its program computes or on its neighbours, the
grouped attention equals a dense causal softmax to float32 rounding and is bit-identical between
a decode row, a prefill tile and the replay's sequence layout, and the tiny Llama's forward in
the mode gives a row the same hidden state and logits at every row count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import registry
from jaxserve.models.batch_invariant import ROW_TILE, batch_invariant, fixed_map, log_softmax, row_tiled
from jaxserve.models.invariant_attention import (GROUP_ROWS, grouped_attention, groups_to_tiles,
                                                 sequence_attention, tiles_to_groups)
from tests.test_replay import model_and_params

# one row of the inputs below taken alone and among T rows (1 tile, 2 tiles, a partial tile, many)
ROW_COUNTS = (2, 7, ROW_TILE, ROW_TILE + 1, 3 * ROW_TILE - 5, 100)


def test_fixed_map_is_map():
    xs = jnp.arange(12.0).reshape(4, 3)
    ys = jnp.arange(4)
    got = fixed_map(lambda x, y: {"s": x.sum() + y, "x": x * 2}, xs, ys)
    np.testing.assert_array_equal(np.asarray(got["s"]), np.asarray(xs.sum(1) + ys))
    np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(xs * 2))


def test_row_tiled_keeps_the_row_shape_and_values():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    w = rng.standard_normal((16, 24)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: row_tiled(lambda t: t @ w, x))(x))
    assert got.shape == (3, 5, 24)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
    with batch_invariant():
        lp = np.asarray(jax.jit(log_softmax)(x[0]))
    np.testing.assert_allclose(lp, np.asarray(jax.nn.log_softmax(x[0], -1)), rtol=0, atol=1e-6)


def _row_alone_and_among(fn, width, seed=0):
    """fn's result for row 0 alone against row `i` of T rows holding it at several offsets."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((128, width)).astype(np.float32)
    jitted = jax.jit(fn)
    alone = np.asarray(jitted(rows[:1]))[0]
    for t in ROW_COUNTS:
        block = rows[1:t + 1].copy()
        i = (7 * t) % t
        block[i] = rows[0]
        got = np.asarray(jitted(block))[i]
        assert np.array_equal(got, alone), f"T={t}: max |delta| {np.abs(got - alone).max():.3g}"


def test_a_tiled_projection_and_norm_give_a_row_the_same_bits_at_every_row_count():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((576, 1536)).astype(np.float32) * 0.05)   # SmolLM2's widths

    def project_and_norm(x):
        def rows(t):
            y = jax.lax.dot_general(t, w, (((1,), (0,)), ((), ())))
            return y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)
        return row_tiled(rows, x)

    _row_alone_and_among(project_and_norm, 576)


def test_the_tiny_model_forward_gives_a_row_the_same_bits_at_every_row_count(tiny_llama_dir):
    config, params = model_and_params(tiny_llama_dir)
    fns = registry.for_config(config).model()

    def no_attention(layer, q, k, v, cache):      # the row-wise parts only: attention is tested below
        return q, cache

    def forward(ids, positions):
        with batch_invariant():
            hidden, _ = fns.forward(params, config, ids, positions, None, no_attention)
            return fns.compute_logits(params, config, hidden)

    rng = np.random.default_rng(2)
    ids = rng.integers(3, config.vocab_size, 128).astype(np.int32)
    positions = rng.integers(0, 500, 128).astype(np.int32)
    jitted = jax.jit(forward)
    alone = np.asarray(jitted(ids[:1], positions[:1]))[0]
    for t in ROW_COUNTS:
        got = np.asarray(jitted(ids[:t], positions[:t]))[0]
        assert np.array_equal(got, alone), f"T={t}: max |delta| {np.abs(got - alone).max():.3g}"


# --- the grouped attention ---------------------------------------------------------------------

N, K, H, BLOCK = 6, 2, 16, 4
SEQ = 83                     # positions of the one sequence below: 21 blocks, 3 chunks of 8 blocks


@pytest.fixture(scope="module")
def sequence():
    """q, k, v of one sequence, and an arena of 48 blocks holding its k, v at random blocks."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((SEQ, n, H)).astype(np.float32) for n in (N, K, K))
    blocks = -(-SEQ // BLOCK)
    table = rng.permutation(np.arange(1, 48))[:blocks].astype(np.int32)        # non-contiguous
    k_cache = rng.standard_normal((48, BLOCK, K, H)).astype(np.float32)
    v_cache = rng.standard_normal((48, BLOCK, K, H)).astype(np.float32)
    pad = ((0, blocks * BLOCK - SEQ), (0, 0), (0, 0))
    k_cache[table] = np.pad(k, pad).reshape(blocks, BLOCK, K, H)
    v_cache[table] = np.pad(v, pad).reshape(blocks, BLOCK, K, H)
    return q, k, v, table, k_cache, v_cache


attend = jax.jit(lambda *a: grouped_attention(*a, sm_scale=H ** -0.5))


def _decode_rows(sequence, positions, width, neighbours, seed=4):
    """Each position as a decode (its own group, 1 real row), after `neighbours` random groups."""
    q, _, _, table, k_cache, v_cache = sequence
    rng = np.random.default_rng(seed)
    groups = neighbours + len(positions)
    qg = rng.standard_normal((groups, GROUP_ROWS, N, H)).astype(np.float32)
    tables = rng.integers(1, 48, (groups, width)).astype(np.int32)
    limits = rng.integers(1, 40, (groups, GROUP_ROWS)).astype(np.int32)
    for g, p in enumerate(positions, start=neighbours):
        qg[g] = 0
        qg[g, 0] = q[p]
        tables[g] = 0
        tables[g, :len(table)] = table
        limits[g] = 0
        limits[g, 0] = p + 1
    return np.asarray(attend(qg, k_cache, v_cache, tables, limits))[neighbours:, 0]


def _prefill_tile(sequence, start, rows, width):
    q, _, _, table, k_cache, v_cache = sequence
    tables = np.zeros((1, width), np.int32)
    tables[0, :len(table)] = table
    limits = np.arange(start + 1, start + rows + 1, dtype=np.int32)[None]
    qg, tg, lg = tiles_to_groups(jnp.asarray(q[start:start + rows][None]), jnp.asarray(tables), jnp.asarray(limits))
    return np.asarray(groups_to_tiles(attend(qg, k_cache, v_cache, tg, lg), 1, rows))


def test_grouped_attention_is_causal_softmax_attention(sequence):
    q, k, v, *_ = sequence
    positions = list(range(SEQ))
    got = _decode_rows(sequence, positions, 24, neighbours=0)
    kk, vv = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)           # [S, N, H]
    scores = np.einsum("tnh,snh->nts", q, kk) * H ** -0.5
    scores = np.where(np.tril(np.ones((SEQ, SEQ), bool))[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("nts,snh->tnh", probs / probs.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_attention_is_bit_identical_across_steps_and_the_replay(sequence):
    q, k, v, *_ = sequence
    positions = [0, 5, 31, 32, 63, 64, 82]
    alone = _decode_rows(sequence, positions, 24, neighbours=0)
    # a wider table, neighbours of other lengths, another group count
    for width, neighbours in ((32, 3), (40, 11)):
        assert np.array_equal(_decode_rows(sequence, positions, width, neighbours), alone)
    # a prefill tile covering positions 60..75 and a partial one at the end
    tile = _prefill_tile(sequence, 60, 16, 24)
    assert np.array_equal(tile[[3, 4]], alone[[4, 5]])
    assert np.array_equal(_prefill_tile(sequence, 78, 5, 32)[-1], alone[-1])

    class Layer:
        sm_scale, sliding_window, soft_cap = H ** -0.5, None, None

    class Config:
        def layer_attention(self, i):
            return Layer

    replay = np.asarray(jax.jit(lambda q, k, v: sequence_attention(Config(), BLOCK)(0, q, k, v, None)[0])(q, k, v))
    assert np.array_equal(replay[positions], alone)
