"""The prefix cache: a radix tree over full KV blocks, with least-recently-used eviction of leaves.

A node stands for one full block of `block_size` tokens whose K/V some step has computed; its
path from the root spells the token prefix those K/V belong to.

Cache salts (tenants) share one root: a prefix's first block is keyed by (salt, block tokens),
every later block by its tokens under its parent. A node is found only through its parent, so in
effect a key is (salt, parent, block tokens): two salts can never share a block, whatever their
tokens. The alternative, a root per salt, needs a second lifecycle (create a root on a salt's
first block, free it when its last child is evicted) that every path out of the tree must get
right; left undone, a salt per user or per request grew the tree without bound. With one root a
salt costs exactly its cached blocks, and eviction stays the only way anything leaves the tree.

The tree holds no references of its own: a node's block is in use while some request's block
table holds it, and cached (evictable) when none does. Eviction takes unreferenced leaves, least
recently used first; a parent becomes a leaf only when its last child goes, so a widely shared
prefix (a system prompt) outlives the conversations hanging off it. Every referenced node's
ancestors are referenced too (a request holds a whole root path), so every unreferenced node can
eventually be evicted, leaf by leaf.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from jaxserve.sched.block_pool import BlockPool


class Node:
    __slots__ = ("block_id", "key", "tokens", "parent", "children", "last_access", "attached")

    def __init__(self, block_id: int, key: Hashable, tokens: tuple[int, ...], parent: Node | None) -> None:
        self.block_id = block_id
        self.key = key  # its key in parent.children: (salt, tokens) under the root, else tokens
        self.tokens = tokens
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.last_access = 0
        self.attached = True  # False once evicted

    def __repr__(self) -> str:
        return f"Node(block={self.block_id}, tokens={self.tokens[:4]}..., last_access={self.last_access})"


class PrefixCache:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._root = Node(-1, None, (), None)  # holds no block; the only node without a parent
        self._clock = 0  # logical time: deterministic, unlike wall time
        # (last_access, tiebreak, node) of nodes that were evictable leaves when pushed; stale
        # entries (touched again, grown a child, evicted) are skipped when popped.
        self._heap: list[tuple[int, int, Node]] = []
        self._pushes = 0
        self._num_nodes = 0
        self.num_evictions = 0  # blocks evicted so far

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, one per cached block (the root, which holds none, is not counted)."""
        return self._num_nodes

    def _key(self, parent: Node, salt: str | None, tokens: tuple[int, ...]) -> Hashable:
        # the salt is spelled once, in a prefix's first block; the path carries it below
        return (salt, tokens) if parent is self._root else tokens

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup and insertion -----------------------------------------------------------------
    def match(self, salt: str | None, token_ids: Sequence[int], max_blocks: int) -> list[Node]:
        """The nodes of the longest cached prefix of token_ids, at most max_blocks blocks.
        Read-only: the caller shares the blocks (incref) and then calls `touch`."""
        node = self._root
        out: list[Node] = []
        bs = self.block_size
        for j in range(min(max_blocks, len(token_ids) // bs)):
            node = node.children.get(self._key(node, salt, tuple(token_ids[j * bs : (j + 1) * bs])))
            if node is None:
                break
            out.append(node)
        return out

    def insert(self, salt: str | None, parent: Node | None, tokens: tuple[int, ...], block_id: int) -> Node:
        """Add a computed full block under `parent` (None: the salt's first block). If that key is
        already cached (another request computed the same block), the existing node is returned
        and the caller should switch to its block."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks enter the cache: got {len(tokens)} tokens, block_size {self.block_size}")
        if parent is not None and not parent.attached:
            raise ValueError(f"parent {parent!r} was evicted while a child was inserted")
        p = self._root if parent is None else parent
        key = self._key(p, salt, tokens)
        node = p.children.get(key)
        if node is None:
            node = Node(block_id, key, tokens, p)
            p.children[key] = node
            self.pool.mark_cached(block_id)
            self._num_nodes += 1
        node.last_access = self._tick()
        return node

    # ---- recency ------------------------------------------------------------------------------
    def touch(self, nodes: Sequence[Node]) -> None:
        """Mark nodes used now (a hit shared them)."""
        for n in nodes:
            n.last_access = self._tick()

    def release(self, nodes: Sequence[Node]) -> None:
        """Called after a request let go of these nodes' blocks. Stamps them (tail first, so a
        chain's tail is older than its head) and queues those nobody uses any more for eviction."""
        for n in reversed(nodes):
            if not n.attached:
                continue
            n.last_access = self._tick()
            if not n.children and self.pool.refcount(n.block_id) == 0:
                self._push(n)

    def _push(self, n: Node) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (n.last_access, self._pushes, n))
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._evictable(e)]
        heapq.heapify(self._heap)

    def _evictable(self, entry: tuple[int, int, Node]) -> bool:
        stamp, _, n = entry
        return n.attached and stamp == n.last_access and not n.children and self.pool.refcount(n.block_id) == 0

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Evict up to n unreferenced leaves, least recently used first; their blocks go back to the
        pool's free list. Returns the evicted block ids in eviction order."""
        out: list[int] = []
        while len(out) < n and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._evictable(entry):
                continue
            node = entry[2]
            parent = node.parent
            del parent.children[node.key]
            node.attached = False
            node.parent = None
            self._num_nodes -= 1
            self.pool.uncache(node.block_id)
            self.num_evictions += 1
            out.append(node.block_id)
            if parent is not self._root and not parent.children and self.pool.refcount(parent.block_id) == 0:
                self._push(parent)  # it keeps its own last_access: it may be older than others
        return out

    def evictable_leaves(self) -> list[Node]:
        """For tests: the current evictable leaves, least recently used first."""
        out = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self._root and not n.children and self.pool.refcount(n.block_id) == 0:
                out.append(n)
        return sorted(out, key=lambda n: n.last_access)

    def all_nodes(self) -> list[Node]:
        """For tests: every cached node."""
        out = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self._root:
                out.append(n)
        return out
