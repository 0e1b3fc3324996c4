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
    assert sched.num_preemptions > 0  # the test really exercised preemption
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    assert_outputs_match_reference(reqs, cfg.max_model_len)


def test_the_most_recently_admitted_request_is_the_victim_and_goes_to_the_front():
    sched = Scheduler(cramped(enable_prefix_caching=False))
    runner = FakeRunner(13, 4)
    a, b, c = (make_request(x, 8, max_tokens=30, ignore_eos=True) for x in "abc")
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    sched.add_request(c)  # arrives after a and b were admitted
    preempted = []
    while not preempted:
        out = sched.schedule()
        preempted = list(out.preempted_ids)
        sched.update(out, runner.execute(out, sched))
    assert preempted == ["c"]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and not c.block_ids
    assert c.num_output_tokens > 0  # kept its outputs
    assert sched.waiting[0] is c
    drive(sched, runner=runner)
    assert_outputs_match_reference([a, b, c], 64)


def test_a_preempted_request_goes_back_in_front_of_newer_waiting_ones():
    sched = Scheduler(cramped(enable_prefix_caching=False, max_num_seqs=2))
    runner = FakeRunner(13, 4)
    reqs = [make_request(f"r{i}", 8, max_tokens=30, ignore_eos=True) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    late = make_request("late", 4, max_tokens=2)
    sched.add_request(late)
    while sched.num_preemptions == 0:
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    assert [r.request_id for r in sched.waiting] == ["r1", "late"]


def test_preemption_with_many_requests_and_a_tiny_pool_leaks_nothing():
    cfg = cramped(num_blocks=9, max_num_seqs=8, max_model_len=32)
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 3 + i % 5, max_tokens=20 - i, ignore_eos=i % 2 == 0) for i in range(10)]
    drive(sched, reqs)
    assert sched.num_preemptions > 0
    assert_outputs_match_reference(reqs, cfg.max_model_len)
