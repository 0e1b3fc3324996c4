"""The scheduler under the engine's one-step-ahead loop: step N+1 is scheduled before step N's
sampled tokens are known, with placeholders for them; what step N+1 did for a request that step N
ended is dropped, and a request never runs past its limits."""

import pytest
from sched_testkit import EOS, FakeRunner, check_drained, check_invariants, make_request

from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.request import RequestStatus
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN


def sched_with(**kw):
    kw.setdefault("num_blocks", 32)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**kw))


def test_a_decode_is_scheduled_again_with_a_placeholder_for_the_token_in_flight():
    s = sched_with()
    s.add_request(make_request("a", [5, 6, 7], max_tokens=4, ignore_eos=True))
    first = s.schedule()
    (sr,) = first.requests
    assert sr.token_ids == (5, 6, 7) and sr.sample and sr.num_placeholders == 0
    second = s.schedule()  # before update(first): the host does not know the sampled token
    (sr2,) = second.requests
    assert sr2.token_ids == (PLACEHOLDER_TOKEN,) and sr2.num_placeholders == 1
    assert sr2.num_computed_tokens == 3 and sr2.sample
    assert sr2.num_output_tokens == 1  # the seeded sampler's index counts the pending token
    req = s.get_request("a")
    assert req.num_computed_tokens == 4 and req.num_pending_output_tokens == 2 and req.output_token_ids == []
    s.update(first, {"a": [11]})
    assert req.output_token_ids == [11] and req.num_pending_output_tokens == 1
    s.update(second, {"a": [12]})
    assert req.output_token_ids == [11, 12] and req.num_pending_output_tokens == 0


def test_a_request_whose_pending_tokens_reach_max_tokens_is_not_scheduled_again():
    s = sched_with()
    s.add_request(make_request("a", [5, 6, 7], max_tokens=2, ignore_eos=True))
    steps = [s.schedule(), s.schedule()]
    assert [len(o.requests) for o in steps] == [1, 1]
    assert not s.schedule().requests  # two tokens pending = max_tokens: nothing more to compute
    s.update(steps[0], {"a": [9]})
    updates = s.update(steps[1], {"a": [10]})
    assert updates[0].finished and updates[0].request.finish_reason == "length"
    assert updates[0].request.output_token_ids == [9, 10]
    check_drained(s)


def test_the_token_of_a_step_scheduled_after_the_request_ended_is_dropped():
    s = sched_with()
    s.add_request(make_request("a", [5, 6, 7], max_tokens=10))
    first, second = s.schedule(), s.schedule()
    (u,) = s.update(first, {"a": [EOS]})
    assert u.finished and u.new_token_ids == (EOS,)
    assert s.update(second, {"a": [33]}) == []  # already finished: its extra token is never seen
    assert u.request.output_token_ids == [EOS]
    check_drained(s)


def test_a_request_preempted_with_a_token_in_flight_still_takes_it_and_is_not_admitted_before():
    s = sched_with(num_blocks=5, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=16,
                   kv_watermark=0.0, admission_output_share=0.0)
    s.add_request(make_request("a", [3] * 8, max_tokens=6, ignore_eos=True))
    s.add_request(make_request("b", [4] * 8, max_tokens=6, ignore_eos=True))
    first = s.schedule()  # both prefill (2 blocks each): the pool is full
    assert len(first.requests) == 2
    second = s.schedule()  # both need a third block at position 8: one is preempted
    assert second.preempted_ids
    victim = s.get_request(second.preempted_ids[0])
    assert victim.status is RequestStatus.PREEMPTED and victim.num_pending_output_tokens == 1
    assert victim.request_id not in {r.request_id for r in second.requests}
    s.update(first, {"a": [20], "b": [21]})
    assert victim.num_pending_output_tokens == 0 and len(victim.output_token_ids) == 1
    check_invariants(s)


def test_update_twice_for_one_step_is_refused():
    s = sched_with()
    s.add_request(make_request("a", [5, 6, 7], max_tokens=4, ignore_eos=True))
    out = s.schedule()
    s.update(out, {"a": [9]})
    with pytest.raises(ValueError, match="once per schedule"):
        s.update(out, {"a": [9]})


def test_a_fork_child_never_shares_a_block_its_parents_step_in_flight_is_still_filling_by_copy():
    # the child's copy-on-write copy runs before its step: it may only copy K/V of earlier steps
    s = sched_with(max_num_batched_tokens=6)
    parent = make_request("p", list(range(3, 13)), max_tokens=2, ignore_eos=True)
    s.add_request(parent)
    s.fork_request("p", make_request("c", list(range(3, 13)), max_tokens=2, ignore_eos=True))
    out = s.schedule()  # the parent's first chunk of 6; the child must wait
    assert [r.request_id for r in out.requests] == ["p"]
    runner = FakeRunner(32, 4)
    s.update(out, runner.execute(out, s))
    out = s.schedule()
    assert {r.request_id for r in out.requests} == {"p"}  # still 4 prompt tokens to go
