"""Work items: every query row in exactly one item, items inside one sequence, tiles cover the keys."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import work_plan as wp


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("group, rows", [(1, 16), (3, 16), (8, 64), (4, 64)])
def test_items_partition_each_sequences_rows_and_cover_its_keys(seed, group, rows):
    rng = np.random.default_rng(seed)
    max_seqs, num_tokens, tile_keys = 5, 24, 16
    n = int(rng.integers(1, max_seqs + 1))
    q_lens = rng.integers(1, 8, n)
    q_lens = q_lens[np.cumsum(q_lens) <= num_tokens]
    n = len(q_lens)
    kv_lens = q_lens + rng.integers(0, 40, n)
    window = int(rng.integers(1, 30)) if seed % 2 else None
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(max_seqs - n, q_lens.sum())]).astype(np.int32)
    kv = np.concatenate([kv_lens, np.full(max_seqs - n, 7)]).astype(np.int32)
    num_items = wp.max_work_items(num_tokens, max_seqs, group, rows)
    meta, item_start = wp.plan_work(jnp.asarray(cu), jnp.asarray(kv), jnp.asarray([n], jnp.int32),
                                    group=group, rows=rows, tile_keys=tile_keys,
                                    num_items=num_items, sliding_window=window)
    meta = np.asarray(meta)
    covered = np.zeros(cu[n] * group, int)
    for it in meta[meta[:, wp.VALID] == 1]:
        s = it[wp.SEQ]
        assert it[wp.ROW0] == cu[s] * group + it[wp.LROW0]
        assert 0 < it[wp.NROWS] <= rows and it[wp.LROW0] + it[wp.NROWS] <= q_lens[s] * group
        covered[it[wp.ROW0]:it[wp.ROW0] + it[wp.NROWS]] += 1
        first = kv[s] - q_lens[s] + it[wp.LROW0] // group
        last = kv[s] - q_lens[s] + (it[wp.LROW0] + it[wp.NROWS] - 1) // group
        lo_key = 0 if window is None else max(0, first - window + 1)
        assert it[wp.TILE_LO] * tile_keys <= lo_key and it[wp.TILE_HI] * tile_keys > last
        assert it[wp.TILE_HI] * tile_keys <= last + tile_keys       # no tile past the last query
    assert np.all(covered == 1)
    assert np.array_equal(np.asarray(item_start)[:n],
                          np.concatenate([[0], np.cumsum(-(-q_lens * group // rows))])[:n])


def test_splits_share_a_tile_range_without_gaps_or_overlap():
    lo, hi = 3, 14
    ranges = [tuple(int(x) for x in wp.split_range(lo, hi, p, 4)) for p in range(4)]
    tiles = [t for a, b in ranges for t in range(a, b)]
    assert tiles == list(range(lo, hi))
