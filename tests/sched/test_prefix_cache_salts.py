"""Cache salts in the prefix cache: a salt costs exactly its cached blocks (a salt per request
must not grow the tree without bound), and two salts never share a block."""

import gc

from hypothesis import given, settings
from hypothesis import strategies as st
from sched_testkit import drive, make_request

from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.kv_cache_manager import KVCacheManager
from jaxserve.sched.prefix_cache import Node
from jaxserve.sched.request import Request

BS = 4


def live_node_objects() -> int:
    """Every Node alive in the process, whatever holds it: the tree's memory, counted from outside
    its own bookkeeping (a root per salt left behind would show here even if num_nodes skipped it)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is Node)


def run_to_completion(kv: KVCacheManager, req: Request) -> bool:
    """What the scheduler and runner do for a one-step prompt: look up, allocate, compute, cache,
    finish. Returns False if the pool could not take it (nothing changed)."""
    prefix = kv.find_cached_prefix(req)
    ok = kv.allocate_slots(req, req.num_tokens - prefix.num_tokens, [], prefix)
    kv.release_pins()
    if not ok:
        return False
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.free(req)
    return True


def evict_everything(kv: KVCacheManager) -> None:
    kv.cache.evict(kv.pool.num_total)
    assert kv.pool.num_cached == 0


def test_twenty_salts_fully_evicted_leave_an_empty_tree():
    kv = KVCacheManager(64, BS)
    start_nodes, start_objects = kv.num_prefix_cache_nodes, live_node_objects()
    prompt = list(range(3, 13))  # two full blocks and a partial one
    for i in range(20):
        assert run_to_completion(kv, Request(f"r{i}", prompt, 4, cache_salt=f"tenant-{i}"))
    assert kv.num_prefix_cache_nodes == 20 * 2  # same tokens, 20 salts: 20 separate copies
    evict_everything(kv)
    assert kv.num_prefix_cache_nodes == start_nodes == 0
    assert kv.cache.all_nodes() == []
    assert live_node_objects() == start_objects


def test_ten_thousand_one_off_salts_leave_the_node_count_where_it_started():
    num_blocks = 33  # 32 usable: every few requests must evict earlier salts' blocks to fit
    kv = KVCacheManager(num_blocks, BS)
    # a long-lived request holds a shared system prompt the whole time: the state to return to
    system = Request("system", list(range(3, 3 + 4 * BS)) + [60], 4)
    prefix = kv.find_cached_prefix(system)
    assert kv.allocate_slots(system, system.num_tokens, [], prefix)
    system.num_computed_tokens = system.num_tokens
    kv.cache_computed_blocks(system)
    start_nodes, start_objects = kv.num_prefix_cache_nodes, live_node_objects()
    assert start_nodes == 4

    evictions_before = kv.cache.num_evictions
    for i in range(10_000):
        prompt = [3 + (i + j) % 50 for j in range(2 * BS + 1)]  # two full blocks, then a token
        assert run_to_completion(kv, Request(f"r{i}", prompt, 4, cache_salt=f"one-off-{i}"))
        assert kv.num_prefix_cache_nodes <= num_blocks - 1  # never more nodes than blocks
        if i % 2_500 == 0:
            # the tree's memory is bounded by the pool, not by the number of salts seen
            assert live_node_objects() <= start_objects + num_blocks
    assert kv.cache.num_evictions - evictions_before > 10_000, "the salts' blocks were reused"

    evict_everything(kv)
    assert kv.num_prefix_cache_nodes == start_nodes
    assert live_node_objects() == start_objects
    # the system prompt, still held, is still found
    again = Request("again", list(system.prompt_token_ids), 4)
    assert kv.find_cached_prefix(again).block_ids == system.block_ids[:4]


def test_the_scheduler_reports_the_tree_size():
    cfg = SchedulerConfig(num_blocks=24, block_size=BS, max_model_len=64, max_num_batched_tokens=64)
    sched = Scheduler(cfg)
    assert sched.stats().prefix_cache_nodes == 0
    prompt = list(range(3, 3 + 2 * BS + 1))
    reqs = [make_request(f"r{i}", prompt, max_tokens=2, ignore_eos=True, cache_salt=f"s{i}") for i in range(3)]
    drive(sched, reqs)
    assert sched.stats().prefix_cache_nodes == len(sched.kv.cache.all_nodes()) == 3 * 2  # no salt shares
    assert sched.reset_prefix_cache()
    assert sched.stats().prefix_cache_nodes == 0
    assert Scheduler(SchedulerConfig(num_blocks=24, block_size=BS, max_model_len=64, max_num_batched_tokens=64,
                                     enable_prefix_caching=False)).stats().prefix_cache_nodes == 0


salts = st.one_of(st.none(), st.text(max_size=3))
prompts = st.lists(st.integers(3, 5), min_size=BS + 1, max_size=4 * BS + 1)  # tiny alphabet: equal blocks


@settings(max_examples=200, deadline=None)
@given(salt_a=salts, salt_b=salts, prompt_a=prompts, prompt_b=prompts)
def test_two_salts_never_share_a_block(salt_a, salt_b, prompt_a, prompt_b):
    kv = KVCacheManager(64, BS)
    a = Request("a", prompt_a, 4, cache_salt=salt_a)
    assert run_to_completion(kv, a)
    b = Request("b", prompt_b, 4, cache_salt=salt_b)
    hit = kv.find_cached_prefix(b)
    if salt_a != salt_b:
        assert hit.num_tokens == 0, f"salt {salt_b!r} found blocks cached under {salt_a!r}"
    else:  # the same salt does share: the longest common run of whole blocks
        common = 0
        while common < min(len(prompt_a), len(prompt_b)) and prompt_a[common] == prompt_b[common]:
            common += 1
        expected = min(common, len(prompt_b) - 1) // BS * BS  # b computes its last token itself
        assert hit.num_tokens == expected
