"""Aborting frees blocks at once, whether the request runs or waits; unknown ids are ignored."""

from sched_testkit import FakeRunner, check_drained, check_invariants, make_request

from jaxserve.sched import RequestStatus, Scheduler, SchedulerConfig


def test_abort_frees_a_running_requests_blocks_and_a_waiting_one_leaves_the_queue():
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4, max_num_seqs=1, enable_prefix_caching=False))
    runner = FakeRunner(32, 4)
    a, b = make_request("a", 10, max_tokens=9), make_request("b", 10, max_tokens=9)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    assert sched.stats().num_kv_blocks_in_use == 3 and sched.stats().num_waiting == 1
    assert sched.abort_requests(["a", "b", "nobody"]) == [a, b]
    assert a.status is b.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    check_drained(sched)
    assert sched.stats().num_kv_blocks_free == sched.stats().num_kv_blocks_total


def test_a_request_aborted_during_a_step_is_skipped_by_update():
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4))
    runner = FakeRunner(32, 4)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 10))
    out = sched.schedule()
    sampled = runner.execute(out, sched)
    sched.abort_requests(["a"])
    updates = sched.update(out, sampled)
    assert [u.request.request_id for u in updates] == ["b"]
    check_invariants(sched)
