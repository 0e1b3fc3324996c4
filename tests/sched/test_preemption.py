"""When blocks run out, the newest running request is preempted by recompute and later resumes
with exactly the tokens it would have produced anyway."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.sched import RequestStatus, Scheduler, SchedulerConfig


def cramped(**kw):
    kw.setdefault("num_blocks", 13)  # 12 usable blocks of 4 tokens
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 64)
    kw.setdefault("max_num_batched_tokens", 32)
    return SchedulerConfig(**kw)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_preempted_requests_resume_with_unchanged_outputs(caching, chunked):
    cfg = cramped(
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=32 if chunked else 64,
    )
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 6 + i, max_tokens=20, ignore_eos=True) for i in range(5)]
    drive(sched, reqs)
    assert sched.stats().num_preemptions > 0  # the test really exercised preemption
    assert sum(r.num_preemptions for r in reqs) == sched.stats().num_preemptions
    assert_outputs_match_reference(reqs, cfg.max_model_len)


def run_until_preemption(sched, runner):
    while True:
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
        if out.preempted_ids:
            return list(out.preempted_ids)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_least_urgent_request_is_the_victim_even_with_more_work_done(policy):
    sched = Scheduler(cramped(enable_prefix_caching=False, admission_output_share=0, scheduling_policy=policy))
    runner = FakeRunner(13, 4)
    background = make_request("bg", 20, max_tokens=28, ignore_eos=True, priority=1)
    urgent = make_request("urgent", 4, max_tokens=40, ignore_eos=True, priority=0)
    sched.add_request(background)
    sched.add_request(urgent)
    assert run_until_preemption(sched, runner) == ["bg"]
    assert background.num_computed_tokens == 0 and background.status is RequestStatus.PREEMPTED
    assert background.num_output_tokens > 0  # it keeps its outputs
    assert urgent.num_computed_tokens < 40  # bg had done more work: priority decided
    drive(sched, runner=runner)
    assert_outputs_match_reference([background, urgent], 64)


def test_among_equals_the_request_with_the_least_computed_work_is_the_victim():
    sched = Scheduler(cramped(enable_prefix_caching=False, admission_output_share=0))
    runner = FakeRunner(13, 4)
    old = make_request("old", 20, max_tokens=28, ignore_eos=True)
    sched.add_request(old)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    young = make_request("young", 4, max_tokens=40, ignore_eos=True)
    sched.add_request(young)
    assert run_until_preemption(sched, runner) == ["young"]
    assert sched.waiting[0] is young and young.num_output_tokens > 0
    drive(sched, runner=runner)
    assert_outputs_match_reference([old, young], 64)


def test_a_preempted_request_goes_back_in_front_of_newer_waiting_ones():
    sched = Scheduler(cramped(enable_prefix_caching=False, max_num_seqs=2))
    runner = FakeRunner(13, 4)
    reqs = [make_request(f"r{i}", 8, max_tokens=30, ignore_eos=True) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    late = make_request("late", 4, max_tokens=2)
    sched.add_request(late)
    while sched.stats().num_preemptions == 0:
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    assert [r.request_id for r in sched.waiting] == ["r1", "late"]


def test_preemption_with_many_requests_and_a_tiny_pool_leaks_nothing():
    cfg = cramped(num_blocks=9, max_num_seqs=8, max_model_len=32)
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 3 + i % 5, max_tokens=20 - i, ignore_eos=i % 2 == 0) for i in range(10)]
    drive(sched, reqs)
    assert sched.stats().num_preemptions > 0
    assert_outputs_match_reference(reqs, cfg.max_model_len)
