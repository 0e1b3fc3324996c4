"""The pool of KV cache blocks: which physical blocks are free, shared, or kept for the prefix cache.

The runner owns one KV arena of `num_blocks` blocks of `block_size` token slots each; this pool
decides, on the host, which of them each request may write. Block 0 is the null block: the runner
pads block tables with it, so it is never handed out and `num_total == num_blocks - 1`.

Every usable block is in exactly one of three states:
  - free:    refcount 0, no content anyone can ask for; on the free list.
  - in use:  refcount >= 1 (a request's block table holds it; forks and prefix hits share it).
  - cached:  refcount 0 but its content is kept in the prefix cache, so it can be revived by a hit
             (refcount back up) or evicted (back to the free list) when the pool runs short.
`num_free + num_cached + num_in_use == num_total` always holds. The pool does not decide what to
evict; the prefix cache does (least recently used leaves) and hands evicted blocks back by
`uncache`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """`allocate` was asked for more blocks than are free; callers check `num_free` first."""


class BlockPool:
    __slots__ = ("num_blocks", "block_size", "_free", "_refcount", "_cached", "_num_cached")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO: a block freed long ago is reused first, which spreads writes over the arena.
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refcount = [0] * num_blocks
        self._cached = [False] * num_blocks  # content held by the prefix cache
        self._num_cached = 0  # blocks with _cached set and refcount 0 (evictable)

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that hold cached content but no request uses: evictable."""
        return self._num_cached

    @property
    def num_in_use(self) -> int:
        return self.num_total - self.num_free - self._num_cached

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._cached[block_id]

    def free_block_ids(self) -> frozenset[int]:
        """For tests and debugging: the blocks on the free list."""
        return frozenset(self._free)

    # ---- transitions --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (refcount 1 each). Raises OutOfBlocksError when fewer are free;
        nothing is taken then."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks already holding content (a fork or a prefix-cache hit)."""
        for b in block_ids:
            self._check_id(b)
            if self._refcount[b] == 0:
                if not self._cached[b]:
                    raise ValueError(f"block {b} is free; only in-use or cached blocks can be shared")
                self._num_cached -= 1
            self._refcount[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block. A block nobody references goes back to the free list,
        or stays cached (evictable) when the prefix cache holds its content."""
        for b in block_ids:
            self._check_id(b)
            if self._refcount[b] <= 0:
                raise ValueError(f"block {b} freed more often than it was referenced")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                if self._cached[b]:
                    self._num_cached += 1
                else:
                    self._free.append(b)

    def mark_cached(self, block_id: int) -> None:
        """The prefix cache took this in-use block's content: when its last user lets go it stays
        cached instead of free."""
        self._check_id(block_id)
        if self._refcount[block_id] == 0:
            raise ValueError(f"block {block_id} is not in use; only computed, held blocks enter the cache")
        self._cached[block_id] = True

    def uncache(self, block_id: int) -> None:
        """The prefix cache evicted this block: it becomes free. Only unreferenced blocks can go."""
        self._check_id(block_id)
        if not self._cached[block_id] or self._refcount[block_id] != 0:
            raise ValueError(
                f"block {block_id} cannot be evicted: cached={self._cached[block_id]}, "
                f"refcount={self._refcount[block_id]}"
            )
        self._cached[block_id] = False
        self._num_cached -= 1
        self._free.append(block_id)

    def _check_id(self, b: int) -> None:
        if not 0 < b < self.num_blocks:
            raise ValueError(f"block id {b} outside 1..{self.num_blocks - 1} (0 is the null block)")
