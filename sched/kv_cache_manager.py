"""Block tables of requests: allocation, sharing (prefix hits, forks), copy-on-write, caching.

The scheduler decides who runs and how many tokens; this module turns that into blocks. It owns
the `BlockPool` and, with prefix caching on, the `PrefixCache`, and keeps for every request the
tree nodes of its leading full blocks, so that newly full blocks can be inserted under them.

Rules that keep the K/V correct:
  - a request only writes slots at positions >= num_computed_tokens, so only its block holding
    that position can be partially computed; if that block is shared (a fork), the writer gets a
    private copy first (copy-on-write: the runner copies src -> dst before the step), and src
    stays referenced until the step's decisions are final, so nothing overwrites it first;
  - a block enters the prefix cache in `cache_computed_blocks`, at the update of a step that
    (or whose successor) fills it, so a request admitted in the same step that fills it can never
    hit K/V no step computes before it: steps run in order on the device;
  - a hit never covers the last known token: something must be computed to get logits;
  - with the host tier (`host_pool`), a hit may run on into blocks the device evicted to host
    memory: the request gets fresh device blocks for them and the step loads them first
    (prefix_cache.py: `loads`, `saves`, and the pins that keep one step's copies apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.sched.block_pool import BlockPool
from jaxserve.sched.kv_events import KVEventLog
from jaxserve.sched.prefix_cache import Node, PrefixCache
from jaxserve.sched.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class SharedPrefix:
    """Blocks a request starts with instead of computing them: a prefix-cache hit or a fork."""

    block_ids: list[int] = field(default_factory=list)  # on the device: shared as they are
    nodes: list[Node] = field(default_factory=list)  # tree nodes of the leading full blocks
    num_tokens: int = 0  # tokens whose K/V the prefix holds (device and host blocks)
    forked: bool = False  # shared from a live parent, not found in the prefix cache
    host_nodes: list[Node] = field(default_factory=list)  # then these, loaded from the host tier


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 host_pool: BlockPool | None = None, host_tier: bool = False, kv_events: bool = False) -> None:
        """host_pool: the engine's host-memory blocks, which swap preemption takes (`take_host`)
        and, with host_tier, the prefix cache's second tier too (device evictions move there).
        kv_events: the prefix cache records its changes (`cache.events`, kv_events.py)."""
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.host_pool = host_pool
        self.cache = (PrefixCache(self.pool, host_pool if host_tier else None,
                                  events=KVEventLog(block_size) if kv_events else None)
                      if enable_prefix_caching else None)
        self._nodes: dict[str, list[Node]] = {}  # request id -> nodes of its leading cached blocks
        self.prefix_cache_queries = 0  # prompt tokens looked up at first admission
        self.prefix_cache_hits = 0  # of those, tokens served from the cache (either tier)
        self.prefix_cache_host_hits = 0  # of those, tokens loaded from the host tier
        self._pinned: list[int] = []  # copy-on-write sources of the step being scheduled

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return self.pool.num_free + self.pool.num_cached

    def blocks_needed(self, req: Request, num_new_tokens: int, prefix: SharedPrefix | None = None) -> int:
        """New blocks (including a copy-on-write copy) that scheduling num_new_tokens would take,
        counting prefix blocks that would leave the evictable set when shared."""
        bs = self.block_size
        if prefix is None:
            held, computed = req.block_ids, req.num_computed_tokens
            revived = 0
        else:
            held, computed = prefix.block_ids, prefix.num_tokens
            revived = sum(1 for b in prefix.block_ids if self.pool.refcount(b) == 0)
        n = max(0, cdiv(computed + num_new_tokens, bs) - len(held)) + revived
        i = computed // bs
        if num_new_tokens > 0 and i < len(held) and self._shared_after(held[i], prefix is not None):
            n += 1
        return n

    def _shared_after(self, b: int, joining: bool) -> bool:
        # a joining request adds its own reference to the prefix blocks
        return self.pool.refcount(b) + (1 if joining else 0) > 1

    # ---- admission ----------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> SharedPrefix:
        """Longest prefix of req's tokens cached in the tree, leaving at least the last token to
        compute (none for a request that skips reading the cache: prompt logprobs). Counts the lookup
        in the hit statistics on a request's first admission."""
        if self.cache is None or req.skip_reading_prefix_cache:
            return SharedPrefix()
        tokens = req.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        nodes = self.cache.match(req.prefix_namespace, tokens, max_blocks)
        on_device = [n for n in nodes if n.on_device]   # device nodes come first (prefix_cache.py)
        return SharedPrefix([n.block_id for n in on_device], on_device, len(nodes) * self.block_size,
                            host_nodes=nodes[len(on_device):])

    def fork_prefix(self, parent: Request, child: Request, parent_computed: int | None = None) -> SharedPrefix:
        """The parent's computed blocks that the child can share: the common computed prefix of
        their tokens, leaving at least the child's last token to compute. `parent_computed` caps
        it at what steps scheduled before the current one compute (a copy-on-write copy runs
        before the step, so it cannot take K/V the same step writes)."""
        if parent.prefix_namespace != child.prefix_namespace:
            return SharedPrefix()  # tenants (and adapters) never share, not even through a fork
        computed = parent.num_computed_tokens if parent_computed is None else parent_computed
        limit = min(computed, parent.num_tokens, child.num_tokens - 1)
        a, b = parent.all_token_ids, child.all_token_ids
        t = 0
        while t < limit and a[t] == b[t]:
            t += 1
        blocks = parent.block_ids[: cdiv(t, self.block_size)]
        nodes = self._nodes.get(parent.request_id, [])[: t // self.block_size]
        return SharedPrefix(list(blocks), list(nodes), t, forked=True)

    def record_lookup(self, req: Request, prefix: SharedPrefix) -> None:
        self.prefix_cache_queries += req.num_prompt_tokens
        hit = min(prefix.num_tokens, req.num_prompt_tokens)
        self.prefix_cache_hits += hit
        self.prefix_cache_host_hits += max(0, hit - len(prefix.nodes) * self.block_size) if prefix.host_nodes else 0

    # ---- allocation ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        copies: list[tuple[int, int]],
        prefix: SharedPrefix | None = None,
        reserve: int = 0,
    ) -> bool:
        """Give req the blocks to write num_new_tokens more tokens, sharing `prefix` first when it
        joins (a hit or a fork). Returns False and changes nothing if fewer than
        `blocks_needed + reserve` blocks are available. Appends any copy-on-write to `copies`."""
        bs = self.block_size
        if prefix is None and req.num_computed_tokens + num_new_tokens <= len(req.block_ids) * bs:
            # the common decode: the slots exist already; only a shared block needs work
            i = req.num_computed_tokens // bs
            if num_new_tokens == 0 or self.pool.refcount(req.block_ids[i]) == 1:
                return True
        need = self.blocks_needed(req, num_new_tokens, prefix)
        if need + reserve > self.num_available:
            return False
        if prefix is not None:
            self.pool.incref(prefix.block_ids)
            req.set_blocks(list(prefix.block_ids))
            req.num_computed_tokens = prefix.num_tokens
            self._nodes[req.request_id] = list(prefix.nodes) + list(prefix.host_nodes)
            if prefix.host_nodes:
                # pinned first (held until release_pins): taking device blocks for them may push
                # other blocks to the host, which may evict host leaves
                self.cache.pin_host(prefix.host_nodes)
                dst = self._take(len(prefix.host_nodes))
                self.cache.load(prefix.host_nodes, dst)
                req.add_blocks(dst)
            if self.cache is not None:
                self.cache.touch(self._nodes[req.request_id])
        i = req.num_computed_tokens // bs
        if num_new_tokens > 0 and i < len(req.block_ids) and self.pool.refcount(req.block_ids[i]) > 1:
            (dst,) = self._take(1)
            src = req.block_ids[i]
            copies.append((src, dst))
            # Keep our reference to src until the step's decisions are final (release_pins): if
            # its other sharers were preempted later in this step, src must not be handed out
            # again (a swap-in would overwrite it before the runner copies it).
            self._pinned.append(src)
            req.replace_block(i, dst)
        grow = cdiv(req.num_computed_tokens + num_new_tokens, bs) - len(req.block_ids)
        if grow > 0:
            req.add_blocks(self._take(grow))
        return True

    def release_pins(self) -> None:
        """End of schedule(): drop the references copy-on-write sources and host-tier loads kept
        during the step."""
        if self._pinned:
            self.pool.free(self._pinned)
            self._pinned = []
        if self.cache is not None:
            self.cache.release_pins()

    def begin_step(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """The step's swap lists: host-tier saves and loads go in them, in the order decided,
        beside swap preemption's (the runner performs every save before any load)."""
        if self.cache is not None:
            self.cache.saves = saves
            self.cache.loads = loads

    def take_events(self) -> list:
        """The prefix cache's KV events since the last call (kv_events.py; [] when not recorded)."""
        events = self.cache.events if self.cache is not None else None
        return events.drain() if events is not None else []

    # ---- the host pool ------------------------------------------------------------------------
    @property
    def num_host_available(self) -> int:
        """Host blocks a swap preemption can have: free ones and the host tier's cached ones."""
        if self.host_pool is None:
            return 0
        return self.host_pool.num_free + self.host_pool.num_cached

    def take_host(self, n: int) -> list[int]:
        """n host blocks for a swap preemption, evicting the host tier's oldest leaves if needed."""
        short = n - self.host_pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict_host(short)
        return self.host_pool.allocate(n)

    def _take(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.pool.allocate(n)

    def swap_in(self, req: Request, host_ids: list[int], num_new_tokens: int, reserve: int = 0) -> list[int] | None:
        """Give a swapped-out request fresh device blocks for its saved K/V (one per host block,
        same order) plus room for num_new_tokens. Returns the device blocks that receive the host
        blocks, or None (nothing changed) if fewer than needed + reserve are available."""
        total = max(len(host_ids), cdiv(req.num_computed_tokens + num_new_tokens, self.block_size))
        if total + reserve > self.num_available:
            return None
        req.set_blocks(self._take(total))
        # the saved blocks re-enter the prefix cache after the next step (cache_computed_blocks
        # then finds any copies the tree still holds and switches to them)
        self._nodes[req.request_id] = []
        return req.block_ids[: len(host_ids)]

    def num_cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of req held in prefix-cache nodes: a recompute would likely find them again."""
        return len(self._nodes.get(req.request_id, ())) * self.block_size

    @property
    def num_prefix_cache_nodes(self) -> int:
        """Nodes in the prefix-cache tree (0 with caching off): what the tree costs in memory."""
        return self.cache.num_nodes if self.cache is not None else 0

    def num_prefix_blocks_in_use(self, prefix: SharedPrefix) -> int:
        return sum(1 for b in prefix.block_ids if self.pool.refcount(b) > 0)

    # ---- after a step -------------------------------------------------------------------------
    def cache_computed_blocks(self, req: Request) -> None:
        """Insert req's full, computed blocks into the prefix cache. If another request already
        cached the same block, switch to that block and free our copy (same K/V: same salt, same
        token prefix) so the cache never holds two copies of one prefix."""
        if self.cache is None:
            return
        nodes = self._nodes.get(req.request_id)
        if nodes is None:
            nodes = self._nodes[req.request_id] = []
        # a block is keyed by its tokens: one still holding a pending (unknown) token must wait;
        # one whose K/V a scheduled step is still writing may enter, since every later step that
        # could hit it runs after that step on the device (the counts read directly: this runs
        # for every request after every step)
        num_full = min(req.num_computed_tokens, len(req.prompt_token_ids) + len(req.output_token_ids)) // self.block_size
        if num_full <= len(nodes):
            return
        bs = self.block_size
        for j in range(len(nodes), num_full):
            parent = nodes[-1] if nodes else None
            own = req.block_ids[j]
            # the block's own tokens only, not a copy of prompt + outputs
            node = self.cache.insert(req.prefix_namespace, parent, req.token_slice(j * bs, (j + 1) * bs), own)
            if node.block_id != own:
                self.pool.incref([node.block_id])
                req.replace_block(j, node.block_id)
                self.pool.free([own])
            nodes.append(node)

    def hold(self, req: Request) -> tuple[list[int], list[Node]]:
        """Take req's blocks and prefix-cache nodes from it without letting them go (a KV
        transfer's sending side keeps them for the receiver); `free_held` lets them go later."""
        held = (req.block_ids, self._nodes.pop(req.request_id, []))
        req.set_blocks([])
        return held

    def free_held(self, block_ids: list[int], nodes: list[Node]) -> None:
        self.pool.free(block_ids)
        if nodes and self.cache is not None:
            self.cache.release(nodes)

    def free(self, req: Request) -> None:
        """Let go of all of req's blocks; its cached full blocks stay in the tree (evictable)."""
        self.pool.free(req.block_ids)
        req.set_blocks([])
        nodes = self._nodes.pop(req.request_id, None)
        if nodes and self.cache is not None:
            self.cache.release(nodes)
