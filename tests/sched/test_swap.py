"""Preemption by swap: a victim's computed blocks go to a host pool and come back into fresh
blocks, so it resumes without recomputing; `auto` chooses by the crossover length."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.sched import RequestStatus, Scheduler, SchedulerConfig


def cramped(**kw):
    kw.setdefault("num_blocks", 13)  # 12 usable blocks of 4
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 48)
    kw.setdefault("max_num_batched_tokens", 32)
    kw.setdefault("admission_output_share", 0.0)  # admit eagerly, so that preemption happens
    kw.setdefault("num_host_blocks", 32)
    return SchedulerConfig(**kw)


@pytest.mark.parametrize("caching", [False, True])
def test_swapped_requests_resume_with_unchanged_outputs_and_no_recompute(caching):
    cfg = cramped(preemption_mode="swap", enable_prefix_caching=caching)
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 6 + i, max_tokens=20, ignore_eos=True) for i in range(5)]
    resumed = []

    def on_step(i, out):
        swapped_in = {d for _, d in out.swap_in}
        resumed.extend(s for s in out.requests if swapped_in & set(s.block_ids))

    drive(sched, reqs, on_step=on_step)
    assert sched.stats().num_preemptions_swap > 0 and sched.stats().num_preemptions_recompute == 0
    assert sched.stats().num_swapped_blocks > 0 and sched.stats().num_host_blocks_in_use == 0
    assert resumed and all(s.num_computed_tokens > 0 for s in resumed)  # nothing recomputed
    assert_outputs_match_reference(reqs, cfg.max_model_len)


def test_auto_mode_swaps_long_contexts_and_recomputes_short_ones():
    cfg = cramped(preemption_mode="auto", swap_crossover_tokens=16, enable_prefix_caching=False,
                  scheduling_policy="priority")
    sched, runner = Scheduler(cfg), FakeRunner(13, 4)
    long_bg = make_request("long", 24, max_tokens=8, ignore_eos=True, priority=1)
    sched.add_request(long_bg)
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    urgent = make_request("urgent", 24, max_tokens=8, ignore_eos=True, priority=0)
    sched.add_request(urgent)
    out = sched.schedule()
    assert out.preempted_ids == ("long",) and long_bg.status is RequestStatus.SWAPPED
    assert len(out.swap_out) == 6  # its 24 computed tokens, in 6 blocks
    sched.update(out, runner.execute(out, sched))
    drive(sched, runner=runner)
    assert (sched.stats().num_preemptions_swap, sched.stats().num_preemptions_recompute) == (1, 0)

    sched, runner = Scheduler(cfg), FakeRunner(13, 4)
    short_bg = make_request("short", 8, max_tokens=30, ignore_eos=True, priority=1)
    sched.add_request(short_bg)
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    sched.add_request(make_request("urgent", 40, max_tokens=4, ignore_eos=True, priority=0))
    out = sched.schedule()
    assert out.preempted_ids == ("short",) and out.swap_out == ()
    assert short_bg.status is RequestStatus.PREEMPTED  # 9 tokens: cheaper to recompute
    sched.update(out, runner.execute(out, sched))
    drive(sched, runner=runner)
    assert (sched.stats().num_preemptions_swap, sched.stats().num_preemptions_recompute) == (0, 1)


def test_a_full_host_pool_falls_back_to_recompute():
    cfg = cramped(preemption_mode="swap", num_host_blocks=1, enable_prefix_caching=False)
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 10, max_tokens=20, ignore_eos=True) for i in range(4)]
    drive(sched, reqs)
    assert sched.stats().num_preemptions_recompute > 0
    assert_outputs_match_reference(reqs, cfg.max_model_len)


def test_aborting_a_swapped_request_frees_its_host_blocks():
    cfg = cramped(preemption_mode="swap", scheduling_policy="priority", enable_prefix_caching=False)
    sched, runner = Scheduler(cfg), FakeRunner(13, 4)
    sched.add_request(make_request("bg", 30, max_tokens=10, ignore_eos=True, priority=3))
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    sched.add_request(make_request("urgent", 30, max_tokens=4, ignore_eos=True, priority=0))
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    assert sched.get_request("bg").status is RequestStatus.SWAPPED and sched.stats().num_host_blocks_in_use == 8
    sched.abort_requests(["bg"])
    assert sched.stats().num_host_blocks_in_use == 0
    drive(sched, runner=runner)


def test_host_block_ids_cover_exactly_zero_to_num_host_blocks_minus_one():
    cfg = cramped(preemption_mode="swap", num_host_blocks=6, enable_prefix_caching=False)
    sched = Scheduler(cfg)
    used = set()

    def on_step(i, out):
        used.update(h for _, h in out.swap_out)
        used.update(h for h, _ in out.swap_in)

    reqs = [make_request(f"r{i}", 10, max_tokens=20, ignore_eos=True) for i in range(4)]
    drive(sched, reqs, on_step=on_step)
    assert sched.stats().num_preemptions_swap > 0
    assert used and used <= set(range(6)) and 0 in used
