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
The "salt" the manager passes is a request's namespace (Request.prefix_namespace): its cache salt,
paired with its LoRA adapter's key when it runs under one, so K/V computed under one adapter is
never served to another or to the base model.

The tree holds no references of its own: a node's block is in use while some request's block
table holds it, and cached (evictable) when none does. Eviction takes unreferenced leaves, least
recently used first; a parent becomes a leaf only when its last child goes, so a widely shared
prefix (a system prompt) outlives the conversations hanging off it. Every referenced node's
ancestors are referenced too (a request holds a whole root path), so every unreferenced node can
eventually be evicted, leaf by leaf.

The host tier (`host_pool`, kv_offload): a block evicted from the device is not forgotten but
moved to host memory, and its node stays in the tree, findable. A node lives in exactly one tier:
`block_id` on the device, or `host_id` in the host pool. Device nodes are closed under ancestors
(a node leaves the device only once no child is on the device; a host chain is loaded back from
its first node, whose parent is on the device), so a match is device nodes, then host nodes.
Moves are decisions, not copies: `saves` (device block, host id) and `loads` (host id, device
block) are lists the scheduler hands in and the runner performs before the step, saves first.
Two rules keep those copies right within one step: a host block a load reads is pinned (held
in use) until the step is scheduled, so no save overwrites it first, and a device block a load
writes is pinned too, so no save reads it before the load wrote it. The host tier evicts its own
least recently used leaves when a save (or a swap preemption) needs room; with nothing to evict
a device eviction forgets the block, as without the tier.

KV events (kv_events.py): with an event log every change of a node's tier is reported, a block
that moves as its removal from one tier and then its storing in the other, so a consumer that
applies them in order holds this tree. A node then carries its block hash, computed once when it
is created.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from jaxserve.sched.block_pool import BlockPool
from jaxserve.sched.kv_events import MEDIUM_DEVICE, MEDIUM_HOST, KVEventLog, block_hash


class Node:
    __slots__ = ("block_id", "host_id", "key", "tokens", "parent", "children", "device_children",
                 "last_access", "attached", "hash")

    def __init__(self, block_id: int, key: Hashable, tokens: tuple[int, ...], parent: Node | None) -> None:
        self.block_id = block_id  # its device block; 0 while it lives in the host tier
        self.host_id = 0          # its host-pool block while it lives in the host tier, else 0
        self.key = key  # its key in parent.children: (salt, tokens) under the root, else tokens
        self.tokens = tokens
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.device_children = 0  # children on the device: a node leaves the device only at 0
        self.last_access = 0
        self.attached = True  # False once evicted
        self.hash = 0  # its block hash, with an event log (kv_events.py); the root's is ROOT_HASH

    @property
    def on_device(self) -> bool:
        return self.block_id > 0

    def __repr__(self) -> str:
        where = f"block={self.block_id}" if self.block_id else f"host={self.host_id}"
        return f"Node({where}, tokens={self.tokens[:4]}..., last_access={self.last_access})"


class PrefixCache:
    def __init__(self, pool: BlockPool, host_pool: BlockPool | None = None,
                 events: KVEventLog | None = None) -> None:
        self.pool = pool
        self.events = events  # None: no KV events are recorded, no block hash is computed
        self.host_pool = host_pool  # the host tier (None: evicted blocks are forgotten)
        self.block_size = pool.block_size
        self._root = Node(-1, None, (), None)  # holds no block; the only node without a parent
        self._clock = 0  # logical time: deterministic, unlike wall time
        # (last_access, tiebreak, node) of nodes that were evictable leaves when pushed; stale
        # entries (touched again, grown a child, evicted) are skipped when popped.
        self._heap: list[tuple[int, int, Node]] = []
        self._host_heap: list[tuple[int, int, Node]] = []   # the same for host-tier leaves
        self._pushes = 0
        self._num_nodes = 0
        self.num_evictions = 0  # blocks evicted from the device so far (moved to the host or forgotten)
        self.num_host_evictions = 0  # blocks forgotten by the host tier
        # the step being scheduled: copies the runner performs before it (set by the caller)
        self.saves: list[tuple[int, int]] = []   # (device block, host-pool id)
        self.loads: list[tuple[int, int]] = []   # (host-pool id, device block)
        self._host_pins: list[int] = []   # host blocks this step's loads read: freed after scheduling
        self._device_pins: list[int] = []  # device blocks this step's loads write: referenced until then
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, one per cached block in either tier (the root is not counted)."""
        return self._num_nodes

    @property
    def num_host_nodes(self) -> int:
        return self.host_pool.num_cached if self.host_pool is not None else 0

    def _key(self, parent: Node, salt: str | None, tokens: tuple[int, ...]) -> Hashable:
        # the salt is spelled once, in a prefix's first block; the path carries it below
        return (salt, tokens) if parent is self._root else tokens

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup and insertion -----------------------------------------------------------------
    def match(self, salt: str | None, token_ids: Sequence[int], max_blocks: int) -> list[Node]:
        """The nodes of the longest cached prefix of token_ids, at most max_blocks blocks: those on
        the device first, then those in the host tier. Read-only: the caller shares the device
        blocks (incref) and loads the host ones (`load`), then calls `touch`."""
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
        already cached on the device (another request computed the same block), the existing node
        is returned and the caller should switch to its block; one in the host tier takes this
        block instead (its host copy is let go: the device now has it)."""
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
            p.device_children += 1
            self.pool.mark_cached(block_id)
            self._num_nodes += 1
            if self.events is not None:
                node.hash = block_hash(p.hash, salt, tokens, first=p is self._root)
                self._stored(node, MEDIUM_DEVICE)
        elif not node.on_device:
            host = node.host_id
            self._to_device(node, block_id)
            self.host_pool.uncache(host)
            if self.events is not None:
                self.events.removed(node.hash, MEDIUM_HOST)
                self._stored(node, MEDIUM_DEVICE)
        node.last_access = self._tick()
        return node

    def _to_device(self, node: Node, block_id: int) -> None:
        node.block_id = block_id
        node.host_id = 0
        node.parent.device_children += 1
        self.pool.mark_cached(block_id)

    def _stored(self, node: Node, medium: str) -> None:
        """Report node's block as stored in `medium` (the caller checked that events are on)."""
        first = node.parent is self._root
        self.events.stored(node.hash, None if first else node.parent.hash, node.tokens, medium,
                           node.key[0] if first else None)

    # ---- the host tier ------------------------------------------------------------------------
    def load(self, nodes: Sequence[Node], block_ids: Sequence[int]) -> None:
        """Bring host-tier nodes (a chain hanging off the device) back into these freshly taken
        device blocks: recorded in `loads`, both sides pinned until `release_pins`."""
        for node, b in zip(nodes, block_ids, strict=True):
            if node.on_device or not node.attached:
                raise ValueError(f"{node!r} is not a host-tier node")
            host = node.host_id
            self.loads.append((host, b))
            self._host_pins.append(host)
            self.pool.incref([b])
            self._device_pins.append(b)
            self._to_device(node, b)
            self.num_loaded_blocks += 1
        if self.events is not None:   # all removals, then the chain as one store
            for node in nodes:
                self.events.removed(node.hash, MEDIUM_HOST)
            for node in nodes:
                self._stored(node, MEDIUM_DEVICE)

    def pin_host(self, nodes: Sequence[Node]) -> None:
        """Hold host-tier nodes a request is about to load, so that making room for it (device
        evictions that save to the host, which may evict host leaves) cannot take them."""
        if nodes:
            self.host_pool.incref([n.host_id for n in nodes])

    def release_pins(self) -> None:
        """The step is scheduled: host blocks its loads read go free (their nodes are on the
        device now), device blocks they write become ordinary blocks of their requests."""
        for h in self._host_pins:
            self.host_pool.free([h])
            self.host_pool.uncache(h)
        self._host_pins = []
        if self._device_pins:
            self.pool.free(self._device_pins)
            self._device_pins = []

    def _host_block(self) -> int:
        """A host block for a save, evicting the host tier's least recently used leaf if none is
        free; 0 when the tier is off or everything in it is held."""
        if self.host_pool is None:
            return 0
        if not self.host_pool.num_free and not self.evict_host(1):
            return 0
        (h,) = self.host_pool.allocate(1)
        self.host_pool.mark_cached(h)
        self.host_pool.free([h])
        return h

    def evict_host(self, n: int) -> int:
        """Forget up to n host-tier leaves, least recently used first (a swap preemption or a save
        needs their room). Returns how many went."""
        done = 0
        while done < n and self._host_heap:
            entry = heapq.heappop(self._host_heap)
            if not self._host_evictable(entry):
                continue
            node = entry[2]
            parent = node.parent
            self._detach(node)
            self.host_pool.uncache(node.host_id)
            node.host_id = 0
            self.num_host_evictions += 1
            if self.events is not None:
                self.events.removed(node.hash, MEDIUM_HOST)
            done += 1
            self._push_if_leaf(parent)
        return done

    def _host_evictable(self, entry: tuple[int, int, Node]) -> bool:
        stamp, _, n = entry
        return (n.attached and not n.on_device and stamp == n.last_access and not n.children
                and self.host_pool.refcount(n.host_id) == 0)

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
            self._push_if_leaf(n)

    def _push_if_leaf(self, n: Node) -> None:
        """Queue n for eviction from its tier if it is an unreferenced leaf there."""
        if n is self._root:
            return
        if n.on_device:
            if not n.device_children and self.pool.refcount(n.block_id) == 0:
                self._push(self._heap, n)
        elif not n.children and self.host_pool.refcount(n.host_id) == 0:
            self._push(self._host_heap, n)

    def _push(self, heap: list, n: Node) -> None:
        self._pushes += 1
        heapq.heappush(heap, (n.last_access, self._pushes, n))
        if len(heap) > 4 * self._num_nodes + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._evictable(e)]
        heapq.heapify(self._heap)
        self._host_heap = [e for e in self._host_heap if self._host_evictable(e)]
        heapq.heapify(self._host_heap)

    def _evictable(self, entry: tuple[int, int, Node]) -> bool:
        stamp, _, n = entry
        return (n.attached and n.on_device and stamp == n.last_access and not n.device_children
                and self.pool.refcount(n.block_id) == 0)

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, n: int) -> list[int]:
        """Evict up to n unreferenced device leaves, least recently used first; their blocks go
        back to the pool's free list (their content saved to the host tier when it has room).
        Returns the evicted block ids in eviction order."""
        out: list[int] = []
        while len(out) < n and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._evictable(entry):
                continue
            node = entry[2]
            parent = node.parent
            block = node.block_id
            host = self._host_block()
            if host:   # moved: findable still, loaded back on a hit
                self.saves.append((block, host))
                self.num_saved_blocks += 1
                node.block_id = 0
                node.host_id = host
                parent.device_children -= 1
                self._push_if_leaf(node)
                if self.events is not None:
                    self.events.removed(node.hash, MEDIUM_DEVICE)
                    self._stored(node, MEDIUM_HOST)
            else:      # forgotten, with whatever hangs below it in the host tier
                self._forget_subtree(node)
            self.pool.uncache(block)
            self.num_evictions += 1
            out.append(block)
            if parent is not self._root and not parent.device_children and self.pool.refcount(parent.block_id) == 0:
                self._push(self._heap, parent)  # it keeps its own last_access: it may be older than others
        return out

    def _detach(self, node: Node) -> None:
        parent = node.parent
        del parent.children[node.key]
        if node.on_device:
            parent.device_children -= 1
        node.attached = False
        node.parent = None
        self._num_nodes -= 1

    def _forget_subtree(self, node: Node) -> None:
        """Detach node and its host-tier descendants (a device node's children are all in the
        host tier when it is evicted), freeing their host blocks."""
        stack = list(node.children.values())
        self._detach(node)
        if self.events is not None:
            self.events.removed(node.hash, MEDIUM_DEVICE)
        while stack:
            d = stack.pop()
            stack.extend(d.children.values())
            self._detach(d)
            self.host_pool.uncache(d.host_id)
            d.host_id = 0
            self.num_host_evictions += 1
            if self.events is not None:
                self.events.removed(d.hash, MEDIUM_HOST)

    def clear(self) -> bool:
        """Forget every cached block in both tiers (K/V of old weights, an arena written by someone
        else). Only while no request holds a device block; returns False otherwise, changing
        nothing (their blocks may be shared with the tree)."""
        if self.pool.num_in_use or self._host_pins:
            return False
        for node in self.all_nodes():
            if node.on_device:
                self.pool.uncache(node.block_id)
            else:
                self.host_pool.uncache(node.host_id)
            node.attached = False
        self._root.children.clear()
        self._root.device_children = 0
        self._heap, self._host_heap = [], []
        self._num_nodes = 0
        if self.events is not None:
            self.events.cleared()
        return True

    def evictable_leaves(self) -> list[Node]:
        """For tests: the current evictable device leaves, least recently used first."""
        out = []
        stack = [self._root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self._root and n.on_device and not n.device_children and self.pool.refcount(n.block_id) == 0:
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
