"""The prefix cache's host tier (kv offload): blocks the device evicts move to the host pool, stay
findable, and a later hit loads them back; outputs never change, and the block accounting of both
tiers holds after every step (sched_testkit.check_invariants checks the host side too)."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.sched import Scheduler, SchedulerConfig

BS = 4


def config(offload: bool, **kw) -> SchedulerConfig:
    kw.setdefault("num_blocks", 1 + 12)       # 12 usable device blocks: room for about two prefixes
    kw.setdefault("num_host_blocks", 64)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_num_seqs", 2)
    return SchedulerConfig(block_size=BS, enable_kv_offload=offload, **kw)


def system_prompts(n: int, blocks: int) -> list[list[int]]:
    return [make_request(f"sys{i}", blocks * BS).prompt_token_ids for i in range(n)]


def rounds(prompts, repeats: int, tail: int = 3, **kw) -> list:
    """Requests cycling over the system prompts, each with its own question: every prompt comes
    back only after the others pushed it out of a device pool that holds about two of them."""
    reqs = []
    for r in range(repeats):
        for i, p in enumerate(prompts):
            q = make_request(f"q{r}-{i}", tail).prompt_token_ids
            reqs.append(make_request(f"r{r}-{i}", p + q, max_tokens=4, ignore_eos=True, **kw))
    return reqs


def run(sched: Scheduler, reqs, **kw) -> int:
    """Drive the workload, a request every third step; returns the prompt tokens computed."""
    prompt_len = {r.request_id: r.num_prompt_tokens for r in reqs}
    computed = [0]

    def count(step, out):
        for s in out.requests:
            computed[0] += max(0, min(prompt_len[s.request_id], s.num_computed_tokens + len(s.token_ids))
                               - s.num_computed_tokens)

    drive(sched, arrivals={3 * i: [r] for i, r in enumerate(reqs)}, on_step=count, **kw)
    return computed[0]


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "one-step-ahead"])
def test_prefixes_that_outgrow_the_device_are_found_again_in_the_host_tier(one_step_ahead):
    prompts = system_prompts(6, blocks=4)   # 24 blocks of prefix: twice the device pool
    results = {}
    for offload in (False, True):
        sched = Scheduler(config(offload))
        reqs = rounds(prompts, repeats=3)
        results[offload] = (sched, run(sched, reqs, one_step_ahead=one_step_ahead))
        assert_outputs_match_reference(reqs, sched.config.max_model_len)
    off, on = results[False][0], results[True][0]
    assert off.kv.prefix_cache_host_hits == 0 and off.kv.cache.num_saved_blocks == 0
    # with the tier: every prompt after the first round is found (4 blocks each), from the host
    assert on.kv.prefix_cache_host_hits == 2 * 6 * 4 * BS
    assert on.kv.prefix_cache_hits > off.kv.prefix_cache_hits
    assert on.kv.cache.num_loaded_blocks == 2 * 6 * 4 and on.kv.cache.num_saved_blocks > 0
    assert results[True][1] < results[False][1]    # fewer prompt tokens computed


def test_a_full_host_tier_forgets_its_least_recently_used_leaves_first():
    prompts = system_prompts(6, blocks=4)
    sched = Scheduler(config(True, num_host_blocks=8))   # the host holds two prefixes
    reqs = rounds(prompts, repeats=2)
    run(sched, reqs)
    assert_outputs_match_reference(reqs, sched.config.max_model_len)
    assert sched.kv.cache.num_host_evictions > 0
    assert sched.host_pool.num_cached <= 8
    # cycling over six prefixes with room for two on the device and two on the host, LRU finds
    # none of the second round in the host tier: each was forgotten before it came back
    assert sched.kv.prefix_cache_host_hits == 0


def test_a_prefix_split_across_the_tiers_is_found_whole():
    prompts = system_prompts(3, blocks=4)
    sched = Scheduler(config(True, num_host_blocks=8))
    reqs = [make_request(f"a{i}", p + [5, 6, 7], max_tokens=2, ignore_eos=True) for i, p in enumerate(prompts)]
    # the first prompt was pushed (its tail first) to the host by the other two, and comes back
    # from both tiers: its head from the device, its tail from the host
    again = make_request("again", prompts[0] + [9, 9], max_tokens=2, ignore_eos=True)
    run(sched, reqs + [again])
    assert_outputs_match_reference(reqs + [again], sched.config.max_model_len)
    assert 0 < sched.kv.prefix_cache_host_hits < sched.kv.prefix_cache_hits
    assert again.num_cached_tokens == 4 * BS


def test_tenants_never_hit_each_others_host_blocks():
    prompts = system_prompts(4, blocks=4)
    sched = Scheduler(config(True))
    a = rounds(prompts, repeats=1, cache_salt="a")
    b = [make_request(r.request_id + "b", r.prompt_token_ids, max_tokens=4, ignore_eos=True, cache_salt="b")
         for r in a]
    run(sched, a + b)
    assert_outputs_match_reference(a + b, sched.config.max_model_len)
    assert sched.kv.prefix_cache_hits == 0 and sched.kv.cache.num_saved_blocks > 0


def test_swap_preemption_takes_its_blocks_from_the_host_tier_when_the_pool_is_full():
    prompts = system_prompts(6, blocks=2)
    cfg = config(True, num_host_blocks=10, preemption_mode="swap", max_num_seqs=4, num_blocks=1 + 10)
    sched = Scheduler(cfg)
    fill = rounds(prompts, repeats=1, tail=1)          # fills the host tier with evicted prefixes
    long = [make_request(f"long{i}", 10, max_tokens=20, ignore_eos=True) for i in range(4)]
    drive(sched, arrivals={**{2 * i: [r] for i, r in enumerate(fill)}, 40: long})
    assert_outputs_match_reference(fill + long, cfg.max_model_len)
    assert sched.stats().num_preemptions_swap > 0
    assert sched.kv.cache.num_host_evictions > 0   # swapped requests pushed cached host blocks out


def test_reset_prefix_cache_forgets_both_tiers():
    prompts = system_prompts(6, blocks=4)
    sched = Scheduler(config(True))
    run(sched, rounds(prompts, repeats=1))
    assert sched.host_pool.num_cached > 0 and sched.kv.pool.num_cached > 0
    assert sched.reset_prefix_cache()
    assert sched.host_pool.num_cached == 0 and sched.kv.pool.num_cached == 0
    assert sched.kv.cache.num_nodes == 0 and sched.host_pool.num_free == sched.host_pool.num_total
    again = rounds(prompts[:1], repeats=1)
    run(sched, again)
    assert_outputs_match_reference(again, sched.config.max_model_len)


def test_the_tier_needs_prefix_caching_and_a_host_pool():
    with pytest.raises(ValueError, match="enable_kv_offload"):
        SchedulerConfig(num_blocks=8, block_size=BS, enable_kv_offload=True, num_host_blocks=0)
    with pytest.raises(ValueError, match="enable_kv_offload"):
        SchedulerConfig(num_blocks=8, block_size=BS, enable_kv_offload=True, num_host_blocks=4,
                        enable_prefix_caching=False)
