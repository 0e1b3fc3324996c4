"""PrefixIndex in pure Python: matching by whole chunks, salts as separate tenants, the LRU bound
evicting leaves (so a shared prefix outlives its branches), clear()."""

import random

import pytest

from jaxserve.router.prefix_index import PrefixIndex


def ids(*chunks, c=4):
    """Token ids from chunk labels: chunk k is [k*c, ..., k*c + c - 1]."""
    return [k * c + j for k in chunks for j in range(c)]


def test_match_counts_whole_chunks_of_the_longest_common_prefix():
    ix = PrefixIndex(chunk_tokens=4)
    ix.insert(None, ids(1, 2, 3) + [999, 998])        # the partial tail is not indexed
    assert ix.num_tokens == 12
    assert ix.match(None, ids(1, 2, 3)) == 12
    assert ix.match(None, ids(1, 2, 7)) == 8
    assert ix.match(None, ids(2, 1)) == 0
    assert ix.match(None, ids(1, 2)[:7]) == 4          # a partial chunk never matches
    assert ix.match(None, []) == 0


def test_a_salt_never_matches_another_salts_prefix():
    ix = PrefixIndex(chunk_tokens=4)
    ix.insert("tenant-a", ids(1, 2, 3))
    assert ix.match("tenant-a", ids(1, 2, 3)) == 12
    assert ix.match("tenant-b", ids(1, 2, 3)) == 0
    assert ix.match(None, ids(1, 2, 3)) == 0
    ix.insert("tenant-b", ids(1, 2))
    assert ix.match("tenant-b", ids(1, 2, 3)) == 8
    assert ix.num_tokens == 20                          # each salt pays for its own chunks


def test_peek_does_not_change_the_eviction_order():
    ix = PrefixIndex(chunk_tokens=4, max_tokens=8)
    ix.insert(None, ids(1))
    ix.insert(None, ids(2))
    assert ix.peek(None, ids(1)) == 4                   # peek: chunk 1 stays least recent
    ix.insert(None, ids(3))
    assert ix.match(None, ids(1)) == 0 and ix.match(None, ids(2)) == 4


def test_lru_bound_evicts_leaves_first_and_keeps_the_shared_prefix():
    ix = PrefixIndex(chunk_tokens=4, max_tokens=16)     # four nodes
    ix.insert(None, ids(1, 2))                          # system prompt 1 + question 2
    ix.insert(None, ids(1, 3))                          # system prompt 1 + question 3
    ix.insert(None, ids(5))
    assert ix.num_tokens == 16
    ix.insert(None, ids(6))                             # evicts the least recent leaf: question 2
    assert ix.num_tokens == 16
    assert ix.match(None, ids(1, 2)) == 4               # the shared chunk 1 stayed
    assert ix.match(None, ids(1, 3)) == 8


def test_clear_forgets_everything():
    ix = PrefixIndex(chunk_tokens=4)
    ix.insert("s", ids(1, 2))
    ix.clear()
    assert ix.num_tokens == 0 and ix.match("s", ids(1, 2)) == 0


def test_a_path_longer_than_the_bound_is_kept_whole_until_the_next_insert():
    ix = PrefixIndex(chunk_tokens=4, max_tokens=8)
    ix.insert(None, ids(1, 2, 3))
    assert ix.match(None, ids(1, 2, 3)) == 12
    ix.insert(None, ids(9))
    assert ix.num_tokens <= 8 + 4


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_keep_the_bound_and_the_tree_consistent(seed):
    rng = random.Random(seed)
    ix = PrefixIndex(chunk_tokens=2, max_tokens=40)
    inserted = []
    for _ in range(200):
        seq = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        salt = rng.choice([None, "a", "b"])
        if rng.random() < 0.6:
            ix.insert(salt, seq)
            inserted.append((salt, seq))
            assert ix.match(salt, seq) == len(seq) // 2 * 2 or len(seq) // 2 > 20
        assert ix.num_tokens <= 40 + 12
        # every node in the LRU is reachable from the root, and vice versa
        reach, stack = set(), [ix._root]
        while stack:
            n = stack.pop()
            for ch in n.children.values():
                assert ch.parent is n
                reach.add(id(ch))
                stack.append(ch)
        assert reach == set(ix._lru)
        # the least recent node is always a leaf
        if ix._lru:
            assert not next(iter(ix._lru.values())).children
        # a match never claims more than some inserted sequence of that salt shares
        salt = rng.choice([None, "a", "b"])
        probe = [rng.randrange(3) for _ in range(10)]
        best = max((_common(probe, s) for t, s in inserted if t == salt), default=0)
        assert ix.peek(salt, probe) <= best // 2 * 2


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefixIndex(chunk_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixIndex(chunk_tokens=16, max_tokens=8)
