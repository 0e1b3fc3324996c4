import pytest

from jaxserve.sched.block_pool import BlockPool, OutOfBlocksError


def test_block_zero_is_reserved_so_total_excludes_it():
    pool = BlockPool(num_blocks=8, block_size=16)
    assert pool.num_total == 7 and pool.num_free == 7 and pool.num_cached == 0
    got = pool.allocate(7)
    assert sorted(got) == list(range(1, 8))


def test_allocating_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(4, 16)
    pool.allocate(2)
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_a_shared_block_is_free_only_after_its_last_reference_goes():
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert pool.refcount(b) == 1 and b not in pool.free_block_ids()
    pool.free([b])
    assert pool.refcount(b) == 0 and b in pool.free_block_ids()
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([b])


def test_a_cached_block_stays_out_of_the_free_list_until_uncached():
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    pool.mark_cached(b)
    pool.free([b])
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (2, 1, 0)
    pool.incref([b])  # a prefix hit revives it
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (2, 0, 1)
    with pytest.raises(ValueError, match="cannot be evicted"):
        pool.uncache(b)
    pool.free([b])
    pool.uncache(b)
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (3, 0, 0)


def test_free_blocks_cannot_be_shared_and_the_null_block_is_never_touched():
    pool = BlockPool(4, 16)
    with pytest.raises(ValueError, match="is free"):
        pool.incref([1])
    with pytest.raises(ValueError, match="null block"):
        pool.free([0])


@pytest.mark.parametrize("num_blocks,block_size", [(1, 16), (8, 0), (2.5, 16)])
def test_bad_pool_sizes_are_rejected_with_their_values(num_blocks, block_size):
    with pytest.raises(ValueError, match=repr(num_blocks) if num_blocks != 8 else repr(block_size)):
        BlockPool(num_blocks, block_size)
