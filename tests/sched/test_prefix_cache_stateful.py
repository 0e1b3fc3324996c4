"""A stateful property test of the block pool + radix tree (through KVCacheManager): random admit,
grow, finish, evict and fork sequences. After every step: reference counts equal the number of
block tables holding each block, free + evictable-cached + in-use == total, no block is both free
and referenced, every cached block still holds the tokens its tree path spells, every live request
reads its own tokens back through its block table, no block is held under two cache salts, the
tree's node count is its number of cached blocks, and eviction takes leaves, least recently used
first."""

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.sched.kv_cache_manager import KVCacheManager
from jaxserve.sched.request import Request

BS = 2
NUM_BLOCKS = 24
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # tiny alphabet: many shared prefixes
# a few recurring tenants, and one-off salts (a salt per request) that must cost nothing once evicted
salt_st = st.one_of(st.sampled_from([None, "", "a", "b"]), st.integers(0, 10**6).map(lambda i: f"once-{i}"))


class PoolAndTree(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.arena = np.full((NUM_BLOCKS, BS), -1)  # [block, offset] -> token id written there
        self.live: dict[str, Request] = {}
        self.n = 0
        self.clock = 0
        self.last_held: dict[int, int] = {}  # block -> the last step a live request held it

    # ---- helpers ----
    def _new(self, tokens, salt):
        self.n += 1
        return Request(f"r{self.n}", list(tokens), 64, cache_salt=salt)

    def _compute(self, req, n, copies):
        """What the runner does: copies first, then write the new tokens' 'K/V'."""
        for src, dst in copies:
            self.arena[dst] = self.arena[src]
        toks = req.all_token_ids
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.arena[req.block_ids[p // BS], p % BS] = toks[p]
        req.num_computed_tokens += n

    def _join(self, req, prefix):
        n = req.num_tokens - prefix.num_tokens
        copies = []
        ok = self.kv.allocate_slots(req, n, copies, prefix)
        self.kv.release_pins()  # what the scheduler does at the end of schedule()
        if not ok:
            return False
        self.live[req.request_id] = req
        return n, copies

    # ---- rules ----
    @rule(tokens=tokens_st, salt=salt_st)
    def admit(self, tokens, salt):
        req = self._new(tokens, salt)
        prefix = self.kv.find_cached_prefix(req)
        assert prefix.num_tokens <= req.num_tokens - 1  # the last token is always computed
        got = self._join(req, prefix)
        if got:
            self._compute(req, *got)
            self.kv.cache_computed_blocks(req)

    @rule(tokens=tokens_st)
    def admit_two_identical_in_one_step(self, tokens):
        # neither can hit the other: the blocks are cached only after the step computed them
        a, b = self._new(tokens, None), self._new(tokens, None)
        pa, pb = self.kv.find_cached_prefix(a), self.kv.find_cached_prefix(b)
        ga = self._join(a, pa)
        gb = self._join(b, pb) if ga else False
        if ga:
            self._compute(a, *ga)
        if gb:
            self._compute(b, *gb)
        for r in (a, b):
            if r.request_id in self.live:
                self.kv.cache_computed_blocks(r)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def grow(self, data, new):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.output_token_ids.extend(new)
        n = req.num_tokens - req.num_computed_tokens
        copies = []
        ok = self.kv.allocate_slots(req, n, copies)
        self.kv.release_pins()
        if ok:
            self._compute(req, n, copies)
            self.kv.cache_computed_blocks(req)
        else:
            del req.output_token_ids[-len(new) :]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3))
    def fork(self, data, extra):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self._new(parent.all_token_ids[: parent.num_computed_tokens] + extra, parent.cache_salt)
        if child.num_tokens == 0:
            return
        prefix = self.kv.fork_prefix(parent, child)
        got = self._join(child, prefix)
        if got:
            shared_partial = prefix.num_tokens % BS and got[0] > 0
            if shared_partial:
                assert got[1], "writing into a shared partial block must copy it first"
            self._compute(child, *got)
            self.kv.cache_computed_blocks(child)

    @rule(k=st.integers(1, 4))
    def evict(self, k):
        for _ in range(k):
            leaves = self.kv.cache.evictable_leaves()
            got = self.kv.cache.evict(1)
            if not leaves:
                assert got == []
                return
            oldest = min(self.last_held[n.block_id] for n in leaves)
            (b,) = got
            assert b in {n.block_id for n in leaves}, "only unreferenced leaves are evicted"
            assert self.last_held[b] == oldest, "eviction must take the least recently used leaf"
            self.arena[b] = -1  # a free block's content is gone

    # ---- invariants ----
    @invariant()
    def note_recency(self):
        # this test's own notion of recency, independent of the tree's clock
        self.clock += 1
        for r in self.live.values():
            for b in r.block_ids:
                self.last_held[b] = self.clock

    @invariant()
    def accounting(self):
        pool = self.kv.pool
        assert pool.num_free + pool.num_cached + pool.num_in_use == pool.num_total
        held: dict[int, int] = {}
        for r in self.live.values():
            assert len(set(r.block_ids)) == len(r.block_ids)
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        free = pool.free_block_ids()
        for b in range(1, NUM_BLOCKS):
            assert pool.refcount(b) == held.get(b, 0)
            assert not (b in free and b in held)
            assert not (b in free and pool.is_cached(b))
        assert pool.num_in_use == len(held)

    @invariant()
    def tree_content(self):
        pool = self.kv.pool
        nodes = self.kv.cache.all_nodes()
        assert len({n.block_id for n in nodes}) == len(nodes)
        assert sum(1 for n in nodes if pool.refcount(n.block_id) == 0) == pool.num_cached
        for n in nodes:
            assert pool.is_cached(n.block_id)
            assert tuple(self.arena[n.block_id]) == n.tokens, "a cached block lost its content"
            if pool.refcount(n.block_id) > 0 and n.parent.parent is not None:
                assert pool.refcount(n.parent.block_id) > 0, "a used block's ancestors are used"

    @invariant()
    def salts_never_share_a_block(self):
        salts: dict[int, set] = {}
        for r in self.live.values():
            for b in r.block_ids:
                salts.setdefault(b, set()).add(r.cache_salt)
        shared = {b: s for b, s in salts.items() if len(s) > 1}
        assert not shared, f"blocks held under more than one salt: {shared}"

    @invariant()
    def node_count_is_the_number_of_cached_blocks(self):
        assert self.kv.num_prefix_cache_nodes == len(self.kv.cache.all_nodes())

    @invariant()
    def requests_read_their_own_tokens(self):
        for r in self.live.values():
            toks = r.all_token_ids
            for p in range(r.num_computed_tokens):
                assert self.arena[r.block_ids[p // BS], p % BS] == toks[p]
            for j, n in enumerate(self.kv._nodes.get(r.request_id, [])):
                assert n.attached and n.block_id == r.block_ids[j]

    def teardown(self):
        for r in list(self.live.values()):
            self.kv.free(r)
        pool = self.kv.pool
        assert pool.num_in_use == 0 and pool.num_free + pool.num_cached == pool.num_total


PoolAndTree.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_pool_and_radix_tree_keep_their_invariants = PoolAndTree.TestCase
