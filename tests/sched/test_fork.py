"""Forking (parallel samples, beams): children share the parent's computed blocks, and a partly
filled shared block is copied before anyone writes into it (copy-on-write)."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.sched import Request, Scheduler, SchedulerConfig


def peak_blocks_in_use(sched, requests, fork_from=None, children=()):
    """The most distinct blocks the block tables of one step referenced."""
    peak = 0

    def on_step(i, out):
        nonlocal peak
        peak = max(peak, len({b for s in out.requests for b in s.block_ids}))

    sched_reqs = list(requests)
    for r in sched_reqs:
        sched.add_request(r)
    for c in children:
        sched.fork_request(fork_from, c)
    drive(sched, on_step=on_step)
    return peak


@pytest.mark.parametrize("caching", [True, False])
def test_four_samples_of_a_long_prompt_use_about_a_quarter_of_the_blocks_of_four_requests(caching):
    cfg = SchedulerConfig(num_blocks=300, block_size=16, max_model_len=1100, max_num_batched_tokens=4096,
                          enable_prefix_caching=caching)
    prompt = make_request("p", 1000).prompt_token_ids
    kw = dict(max_tokens=8, ignore_eos=True)
    independent = [make_request(f"i{k}", prompt, **kw) for k in range(4)]
    alone = peak_blocks_in_use(Scheduler(cfg), independent)
    parent = make_request("s0", prompt, **kw)
    children = [make_request(f"s{k}", prompt, **kw) for k in range(1, 4)]
    forked = peak_blocks_in_use(Scheduler(cfg), [parent], "s0", children)
    assert alone == 4 * 63  # 1,000 tokens: 62 full blocks + 1 partial, each
    assert forked == 63 + 3  # shared prompt + one copied partial block per extra sample
    assert 0.24 < forked / alone < 0.30
    sched = Scheduler(cfg)
    peak_blocks_in_use(sched, [make_request("q0", prompt, **kw)], "q0", [make_request(f"q{k}", prompt, **kw) for k in (1, 2, 3)])
    assert sched.num_kv_blocks_in_use_peak == forked
    assert_outputs_match_reference(independent + [parent] + children, cfg.max_model_len)


def test_a_child_waits_for_its_parents_prefill_then_computes_only_the_last_token():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=8))
    runner = FakeRunner(64, 4)
    prompt = make_request("x", 30).prompt_token_ids
    parent, child = make_request("p", prompt, max_tokens=4), make_request("c", prompt, max_tokens=4)
    sched.add_request(parent)
    sched.fork_request("p", child)
    steps = []
    while child.num_output_tokens == 0:
        out = sched.schedule()
        steps.append([(s.request_id, s.num_computed_tokens, len(s.token_ids)) for s in out.requests])
        copies = out.block_copies
        sched.update(out, runner.execute(out, sched))
    assert steps[:4] == [[("p", 0, 8)], [("p", 8, 8)], [("p", 16, 8)], [("p", 24, 6)]]
    assert steps[4] == [("p", 30, 1), ("c", 29, 1)]
    # the parent ran first and wrote into block 7 alone; the child joined after it, sharing
    # block 7, so the child writes into a copy
    assert runner.num_copies == 1 and len(copies) == 1 and copies[0][0] == parent.block_ids[7]
    assert child.num_cached_tokens == 29
    assert sched.stats().prefix_cache_hits == 0  # sharing with a fork parent is not a prefix-cache hit
    drive(sched, runner=runner)
    assert_outputs_match_reference([parent, child], sched.config.max_model_len)


def test_a_beam_fork_shares_the_computed_prefix_and_continues_with_its_own_token():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, enable_prefix_caching=False))
    runner = FakeRunner(64, 4)
    parent = make_request("p", 10, max_tokens=12, ignore_eos=True)
    sched.add_request(parent)
    for _ in range(4):
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    base = parent.all_token_ids[:-1]  # the beam replaces the last sampled token by another one
    alt = 3 if parent.output_token_ids[-1] != 3 else 4
    beam = make_request("b", base + [alt], max_tokens=5, ignore_eos=True)
    sched.fork_request("p", beam)
    out = sched.schedule()
    (sb,) = [s for s in out.requests if s.request_id == "b"]
    assert sb.num_computed_tokens == 13 and sb.token_ids == (alt,)
    # the parent wrote position 13 into block 3 before the beam joined; the beam writes a copy
    assert out.block_copies == ((parent.block_ids[3], sb.block_ids[3]),)
    sched.update(out, runner.execute(out, sched))
    drive(sched, runner=runner)
    assert_outputs_match_reference([parent, beam], sched.config.max_model_len)


def test_a_child_whose_parent_ended_runs_on_its_own():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, enable_prefix_caching=False))
    prompt = make_request("x", 12).prompt_token_ids
    parent, child = make_request("p", prompt), make_request("c", prompt)
    sched.add_request(parent)
    sched.fork_request("p", child)
    sched.abort_requests(["p"])
    drive(sched)
    assert_outputs_match_reference([child], sched.config.max_model_len)


def test_fork_rejects_an_unknown_parent_and_a_foreign_salt():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4))
    sched.add_request(make_request("p", 5, cache_salt="alice"))
    with pytest.raises(ValueError, match="parent 'nobody' is not a live request"):
        sched.fork_request("nobody", make_request("c", 5))
    with pytest.raises(ValueError, match="cache_salt 'bob' differs from the parent's 'alice'"):
        sched.fork_request("p", make_request("c", 5, cache_salt="bob"))
    with pytest.raises(ValueError, match="already in the scheduler"):
        sched.fork_request("p", Request("p", [1, 2], 3, cache_salt="alice"))
