"""How requests end: EOS, stop tokens, max_tokens, max_model_len, and the engine's stop strings."""

import numpy as np
from sched_testkit import EOS, FakeRunner, make_request, next_token

from jaxserve.sched import RequestStatus, Scheduler, SchedulerConfig


def run(req, max_model_len=64):
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=max_model_len))
    runner = FakeRunner(64, 4)
    sched.add_request(req)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    assert sched.stats().num_kv_blocks_free + sched.stats().num_kv_blocks_cached == sched.stats().num_kv_blocks_total
    return req


def prompt_whose_next_token_is(token, *, after=0):
    """A prompt after which the fake model emits `token` as output number `after` (0-based)."""
    rng = np.random.default_rng(0)
    for _ in range(100_000):
        p = rng.integers(3, 64, size=6).tolist()
        seq = list(p)
        for _ in range(after):
            seq.append(next_token(seq))
        if next_token(seq) == token and not {EOS, token} & set(seq[len(p):]):
            return p
    raise AssertionError("no such prompt")


def test_eos_ends_a_request_with_reason_stop_and_is_kept_in_the_outputs():
    req = run(make_request("a", prompt_whose_next_token_is(EOS, after=2), max_tokens=10))
    assert req.finish_reason == "stop" and req.stop_reason is None
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert req.output_token_ids[-1] == EOS and req.num_output_tokens == 3


def test_ignore_eos_runs_to_max_tokens():
    req = run(make_request("a", prompt_whose_next_token_is(EOS, after=2), max_tokens=10, ignore_eos=True))
    assert req.finish_reason == "length" and req.num_output_tokens == 10
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_eos_before_min_tokens_does_not_stop():
    req = run(make_request("a", prompt_whose_next_token_is(EOS, after=2), max_tokens=10, min_tokens=4))
    assert req.num_output_tokens >= 4 and req.output_token_ids[2] == EOS


def test_a_stop_token_ends_the_request_and_is_its_stop_reason():
    p = prompt_whose_next_token_is(40, after=1)
    req = run(make_request("a", p, max_tokens=10, stop_token_ids={40}))
    assert req.finish_reason == "stop" and req.stop_reason == 40 and req.output_token_ids[-1] == 40
    assert req.num_output_tokens == 2


def test_a_stop_token_before_min_tokens_does_not_stop():
    p = prompt_whose_next_token_is(40, after=1)
    req = run(make_request("a", p, max_tokens=10, min_tokens=3, stop_token_ids={40}))
    assert req.num_output_tokens >= 3 and req.output_token_ids[1] == 40


def test_max_tokens_ends_with_reason_length():
    req = run(make_request("a", 7, max_tokens=5, ignore_eos=True))
    assert (req.finish_reason, req.stop_reason, req.num_output_tokens) == ("length", None, 5)


def test_reaching_max_model_len_ends_with_reason_length():
    # a resumed or forked request may carry outputs; it still stops at max_model_len
    req = make_request("a", 10, max_tokens=30, ignore_eos=True)
    req.output_token_ids = [5] * 20
    req = run(req, max_model_len=40)
    assert req.finish_reason == "length" and req.num_tokens == 40


def test_a_stop_string_found_by_the_engine_ends_the_request_and_frees_its_blocks():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64))
    runner = FakeRunner(64, 4)
    req = make_request("a", 9, max_tokens=30, ignore_eos=True)
    sched.add_request(req)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, runner.execute(out, sched))
    ended = sched.finish_requests(["a", "unknown"], "stop", stop_reason="\n\n")
    assert ended == [req] and req.finish_reason == "stop" and req.stop_reason == "\n\n"
    assert not sched.has_unfinished_requests() and sched.stats().num_kv_blocks_in_use == 0


def test_update_reports_new_tokens_and_finishing():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64))
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", 5, max_tokens=2, ignore_eos=True))
    out = sched.schedule()
    (u,) = sched.update(out, runner.execute(out, sched))
    assert len(u.new_token_ids) == 1 and not u.finished
    out = sched.schedule()
    (u,) = sched.update(out, runner.execute(out, sched))
    assert u.finished and u.request.finish_reason == "length"


def test_finishing_by_stop_keeps_a_stop_reason_the_engine_already_set():
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64))
    req = make_request("a", 9, max_tokens=30)
    sched.add_request(req)
    req.stop_reason = "END"
    sched.finish_requests(["a"])
    assert (req.finish_reason, req.stop_reason) == ("stop", "END")
