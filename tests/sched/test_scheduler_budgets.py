"""Token budget, seat budget, chunked prefill and continuous batching."""

import pytest
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.sampling import SamplingOptions


def config(**kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 256)
    return SchedulerConfig(**kw)


def step(sched, runner):
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched))
    return out


def test_no_step_computes_more_tokens_than_the_budget():
    cfg = config(max_num_batched_tokens=16, max_model_len=64)
    sched = Scheduler(cfg)
    reqs = [make_request(f"r{i}", 10 + i, max_tokens=5) for i in range(6)]
    sizes = []
    drive(sched, reqs, on_step=lambda i, out: sizes.append(out.num_batched_tokens))
    assert max(sizes) == 16  # the budget was reached, never exceeded
    assert_outputs_match_reference(reqs, cfg.max_model_len)


def test_no_more_requests_run_at_once_than_there_are_seats():
    sched = Scheduler(config(max_num_seqs=3))
    reqs = [make_request(f"r{i}", 5, max_tokens=6) for i in range(7)]
    counts = []
    drive(sched, reqs, on_step=lambda i, out: counts.append((len(out.requests), sched.stats().num_running)))
    assert max(n for n, _ in counts) == 3 and max(r for _, r in counts) <= 3


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    sched = Scheduler(config(max_num_batched_tokens=8))
    runner = FakeRunner(64, 4)
    req = make_request("long", 30, max_tokens=3)
    sched.add_request(req)
    chunks = []
    for _ in range(4):
        out = step(sched, runner)
        (sr,) = out.requests
        chunks.append((sr.num_computed_tokens, len(sr.token_ids), sr.sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    assert req.num_output_tokens == 1
    drive(sched, runner=runner)
    assert_outputs_match_reference([req], 256)


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    sched = Scheduler(config(max_num_batched_tokens=64, long_prefill_token_threshold=5, max_num_partial_prefills=2))
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", 12, max_tokens=2))
    sched.add_request(make_request("b", 12, max_tokens=2))
    out = step(sched, runner)
    assert [len(s.token_ids) for s in out.requests] == [5, 5]


def test_with_chunking_off_a_prompt_runs_whole_or_waits():
    cfg = config(num_blocks=128, max_num_batched_tokens=256, enable_chunked_prefill=False)
    sched = Scheduler(cfg)
    runner = FakeRunner(128, 4)
    sched.add_request(make_request("a", 200, max_tokens=2))
    sched.add_request(make_request("b", 100, max_tokens=2))
    out = step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("a", 200)]
    out = step(sched, runner)  # a decodes (1 token); b's 100 tokens fit whole now
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("a", 1), ("b", 100)]


def test_chunking_off_needs_a_budget_that_holds_the_longest_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens=128 must be >= max_model_len=256"):
        config(max_num_batched_tokens=128, enable_chunked_prefill=False)


def test_a_new_request_joins_the_batch_while_others_decode():
    sched = Scheduler(config(max_num_batched_tokens=64))
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", 6, max_tokens=20))
    sched.add_request(make_request("b", 6, max_tokens=20))
    step(sched, runner)
    step(sched, runner)
    sched.add_request(make_request("c", 9, max_tokens=20))
    out = step(sched, runner)
    assert [(s.request_id, len(s.token_ids), s.sample) for s in out.requests] == [
        ("a", 1, True),
        ("b", 1, True),
        ("c", 9, True),
    ]
    assert [sched.get_request(r).num_output_tokens for r in "abc"] == [3, 3, 1]


def test_running_requests_come_before_waiting_ones_and_decodes_are_never_empty():
    sched = Scheduler(config(max_num_batched_tokens=10))
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", 9, max_tokens=20))
    step(sched, runner)
    sched.add_request(make_request("b", 40, max_tokens=2))
    out = step(sched, runner)
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("a", 1), ("b", 9)]
    assert all(len(s.token_ids) > 0 for s in out.requests)


def test_scheduled_request_describes_its_step_exactly():
    sched = Scheduler(config(max_num_batched_tokens=64))
    runner = FakeRunner(64, 4)
    req = make_request("a", [5, 6, 7, 8, 9], max_tokens=4, sampling=SamplingOptions(seed=1))
    sched.add_request(req)
    out = step(sched, runner)
    (sr,) = out.requests
    assert sr.token_ids == (5, 6, 7, 8, 9) and sr.num_computed_tokens == 0 and sr.sample
    assert len(sr.block_ids) == 2 and sr.num_output_tokens == 0 and sr.sampling == SamplingOptions(seed=1)
    out = step(sched, runner)
    (sr,) = out.requests
    assert sr.token_ids == (req.output_token_ids[0],) and sr.num_computed_tokens == 5
    assert sr.num_output_tokens == 1


def test_an_empty_scheduler_schedules_nothing():
    out = Scheduler(config()).schedule()
    assert out.requests == () and out.num_batched_tokens == 0


def test_decode_step_prefill_cap_applies_only_while_someone_decodes():
    sched = Scheduler(config(max_num_batched_tokens=32, decode_step_prefill_cap=8))
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("first", 40, max_tokens=20))
    out = step(sched, runner)               # nobody decodes: the prompt takes the whole budget
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("first", 32)]
    step(sched, runner)                     # the last 8 prompt tokens; "first" samples its first token
    sched.add_request(make_request("second", 40, max_tokens=2))
    out = step(sched, runner)               # "first" decodes, so "second" gets only the ITL chunk
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("first", 1), ("second", 8)]
    drive(sched, runner=runner)
    assert sched.stats().num_running == sched.stats().num_waiting == 0


def test_decode_step_prefill_cap_is_validated():
    with pytest.raises(ValueError, match="decode_step_prefill_cap must be an int >= 0"):
        config(decode_step_prefill_cap=-1)


def test_fewer_decodes_get_the_finer_cap():
    c = config(max_num_batched_tokens=32, decode_step_prefill_cap=16, decode_step_prefill_caps=((1, 4), (3, 8)))
    assert [c.prefill_cap_beside(d) for d in (1, 2, 3, 4, 9)] == [4, 8, 8, 16, 16]
    sched = Scheduler(c)
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("first", 8, max_tokens=20))
    step(sched, runner)                     # "first" prefills whole and samples its first token
    sched.add_request(make_request("second", 40, max_tokens=2))
    out = step(sched, runner)               # one decode beside: the 1-decode cap
    assert [(s.request_id, len(s.token_ids)) for s in out.requests] == [("first", 1), ("second", 4)]
    drive(sched, runner=runner)
    assert sched.stats().num_running == sched.stats().num_waiting == 0


@pytest.mark.parametrize("caps", [((4, 8), (2, 4)), ((0, 8),), ((2, 0),)])
def test_decode_step_prefill_caps_are_validated(caps):
    with pytest.raises(ValueError, match="decode_step_prefill_caps"):
        config(decode_step_prefill_caps=caps)
