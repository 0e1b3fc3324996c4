"""Prefix caching in the scheduler: hits at admission, salts, eviction order, same outputs."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, check_invariants, drive, make_request

from jaxserve.sched import Scheduler, SchedulerConfig


def config(**kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_batched_tokens", 64)
    return SchedulerConfig(**kw)


def first_step_of(sched, runner, req):
    """Add req, run one step, return its ScheduledRequest in that step."""
    sched.add_request(req)
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    return next(s for s in out.requests if s.request_id == req.request_id)


def test_a_second_request_with_the_same_prompt_computes_only_the_uncached_tail():
    sched, runner = Scheduler(config()), FakeRunner(64, 4)
    prompt = make_request("x", 22).prompt_token_ids
    a = make_request("a", prompt, max_tokens=3, ignore_eos=True)
    drive(sched, [a], runner=runner)
    b = make_request("b", prompt, max_tokens=3, ignore_eos=True)
    sr = first_step_of(sched, runner, b)
    assert sr.num_computed_tokens == 20 and sr.token_ids == tuple(prompt[20:])
    assert b.num_cached_tokens == 20
    assert (sched.stats().prefix_cache_queries, sched.stats().prefix_cache_hits) == (44, 20)
    drive(sched, runner=runner)
    assert_outputs_match_reference([a, b], 128)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, runner = Scheduler(config()), FakeRunner(64, 4)
    prompt = make_request("x", 16).prompt_token_ids
    drive(sched, [make_request("a", prompt, max_tokens=2)], runner=runner)
    sr = first_step_of(sched, runner, make_request("b", prompt, max_tokens=2))
    assert sr.num_computed_tokens == 12 and len(sr.token_ids) == 4 and sr.sample


def test_a_preempted_request_resumes_from_its_own_cached_blocks():
    cfg = config(num_blocks=13, max_model_len=48, max_num_batched_tokens=32)
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 10, max_tokens=24, ignore_eos=True) for i in range(4)]
    resumed = []
    sched_steps = []

    def on_step(i, out):
        sched_steps.append(out)

    drive(sched, reqs, on_step=on_step)
    assert sched.stats().num_preemptions > 0
    for out in sched_steps:
        for s in out.requests:
            r = next(r for r in reqs if r.request_id == s.request_id)
            if r.num_preemptions and s.num_output_tokens > 0 and len(s.token_ids) > 1:
                resumed.append(s.num_computed_tokens)
    assert resumed and max(resumed) > 0  # at least one re-prefill started from cached blocks
    assert_outputs_match_reference(reqs, cfg.max_model_len)


def test_requests_admitted_in_the_same_step_cannot_hit_each_other():
    sched, runner = Scheduler(config()), FakeRunner(64, 4)
    prompt = make_request("x", 20).prompt_token_ids
    a, b = (make_request(r, prompt, max_tokens=5, ignore_eos=True) for r in "ab")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [s.num_computed_tokens for s in out.requests] == [0, 0]
    sched.update(out, runner.execute(out, sched))
    drive(sched, runner=runner)
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    # both computed the same 6 full blocks; the tree keeps one copy of each
    assert sched.stats().num_kv_blocks_cached == 6
    assert_outputs_match_reference([a, b], 128)


def test_requests_with_different_salts_never_share_a_block():
    sched, runner = Scheduler(config()), FakeRunner(64, 4)
    prompt = make_request("x", 30).prompt_token_ids
    drive(sched, [make_request("a", prompt, cache_salt="alice")], runner=runner)
    hits = sched.stats().prefix_cache_hits
    for rid, salt in (("b", "bob"), ("c", None)):
        sr = first_step_of(sched, runner, make_request(rid, prompt, cache_salt=salt))
        assert sr.num_computed_tokens == 0
    assert sched.stats().prefix_cache_hits == hits == 0
    sr = first_step_of(sched, runner, make_request("d", prompt, cache_salt="alice"))
    assert sr.num_computed_tokens == 28
    drive(sched, runner=runner)


def test_a_shared_system_prompt_outlives_the_conversations_hanging_off_it():
    cfg = config(num_blocks=17, max_model_len=64)  # 16 usable blocks of 4
    sched, runner = Scheduler(cfg), FakeRunner(17, 4)
    system = make_request("sys", 8).prompt_token_ids  # 2 full blocks
    chats = [make_request(f"c{i}", system + make_request(f"q{i}", 8).prompt_token_ids, max_tokens=4) for i in range(3)]
    for c in chats:
        drive(sched, [c], runner=runner)
    assert sched.stats().num_kv_blocks_cached == 2 + 3 * 2  # the system prompt once, 2 own blocks per chat
    # a stranger needs most of the pool: conversations' leaves go, the system prompt stays
    stranger = make_request("s", 40, max_tokens=8)
    drive(sched, [stranger], runner=runner)
    assert sched.kv.cache.num_evictions > 0
    sr = first_step_of(sched, runner, make_request("late", system + [5, 6, 7], max_tokens=2))
    assert sr.num_computed_tokens == 8
    drive(sched, runner=runner)


def test_the_least_recently_used_conversation_is_evicted_first():
    cfg = config(num_blocks=25)  # 24 usable blocks of 4
    sched, runner = Scheduler(cfg), FakeRunner(25, 4)
    old, new = make_request("old", 16, max_tokens=1), make_request("new", 16, max_tokens=1)
    drive(sched, [old], runner=runner)
    drive(sched, [new], runner=runner)
    assert sched.stats().num_kv_blocks_cached == 8
    # 79 computed tokens take 20 blocks: 16 free, so 4 cached blocks must go
    drive(sched, [make_request("filler", 78, max_tokens=2)], runner=runner)
    check_invariants(sched)
    assert sched.kv.cache.num_evictions == 4
    cached = [sched.kv.find_cached_prefix(r).num_tokens for r in (old, new)]  # a read-only lookup
    assert cached == [0, 16]  # old lost all 4 blocks, new kept all 4


@pytest.mark.parametrize("threshold", [0, 6])
def test_a_partly_cached_prompt_is_chunked_from_where_the_cache_ends(threshold):
    sched = Scheduler(config(max_num_batched_tokens=8, long_prefill_token_threshold=threshold))
    runner = FakeRunner(64, 4)
    prompt = make_request("x", 40).prompt_token_ids
    drive(sched, [make_request("a", prompt[:24], max_tokens=1)], runner=runner)
    b = make_request("b", prompt, max_tokens=2, ignore_eos=True)
    sched.add_request(b)
    starts = []
    while b.num_output_tokens == 0:
        out = sched.schedule()
        starts += [(s.num_computed_tokens, len(s.token_ids)) for s in out.requests]
        sched.update(out, runner.execute(out, sched))
    step = threshold or 8
    assert starts[0] == (24, step) and sum(n for _, n in starts) == 16
    drive(sched, runner=runner)
    assert_outputs_match_reference([b], 128)


@pytest.mark.parametrize("caching", [True, False])
def test_outputs_are_identical_with_the_cache_on_or_off_under_eviction_pressure(caching):
    cfg = config(num_blocks=21, max_model_len=48, max_num_batched_tokens=12, enable_prefix_caching=caching)
    sched = Scheduler(cfg)
    system = make_request("sys", 10).prompt_token_ids
    reqs = [
        make_request(f"r{i}", system + make_request(f"q{i}", 3 + i % 7).prompt_token_ids, max_tokens=6 + i % 5)
        for i in range(16)
    ]
    arrivals = {2 * i: [r] for i, r in enumerate(reqs)}
    drive(sched, arrivals=arrivals)
    assert_outputs_match_reference(reqs, cfg.max_model_len)
    if caching:
        assert sched.stats().prefix_cache_hits > 0 and sched.kv.cache.num_evictions > 0
    else:
        assert sched.stats().prefix_cache_hits == 0 and sched.stats().num_kv_blocks_cached == 0


def test_reset_prefix_cache_empties_the_tree_only_between_workloads():
    from jaxserve.sched.request import Request
    from jaxserve.sched.scheduler import Scheduler
    from jaxserve.sched.scheduler_config import SchedulerConfig

    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                                  max_model_len=64))
    s.add_request(Request("a", list(range(1, 17)), 2))
    out = s.schedule()
    s.update(out, {"a": [5]})
    assert not s.reset_prefix_cache()          # a live request: nothing changes
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, {r.request_id: [5] for r in out.requests if r.sample})
    assert s.stats().num_kv_blocks_cached > 0
    assert s.reset_prefix_cache()
    st = s.stats()
    assert st.num_kv_blocks_cached == 0 and st.num_kv_blocks_free == st.num_kv_blocks_total
