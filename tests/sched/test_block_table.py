"""A request's block table crosses to the runner as one tuple per change, not a copy per step:
the step's entries carry the same object while no block is added or replaced, a new one after
a block is added, a shared block copied on write, a prefix-cache duplicate dropped, or the
request preempted; the runner's table follows it (its rows are checked against a fresh pack)."""

import dataclasses

import numpy as np
from sched_testkit import FakeRunner, assert_outputs_match_reference, drive, make_request

from tests.packing_oracle import pack_step
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.persistent_batch import PersistentBatch
from jaxserve.sched import Scheduler, SchedulerConfig


def _config(**kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return SchedulerConfig(**kw)


def test_the_table_is_the_same_object_until_a_block_is_added():
    sched = Scheduler(_config())
    runner = FakeRunner(64, 4)
    sched.add_request(make_request("a", 6, max_tokens=12))
    tables = []
    for _ in range(10):
        out = sched.schedule()
        [sr] = out.requests
        tables.append((sr.num_computed_tokens, sr.block_ids))
        sched.update(out, runner.execute(out, sched))
    for (c0, t0), (c1, t1) in zip(tables, tables[1:]):
        same_blocks = len(t0) == len(t1)
        assert (t1 is t0) == same_blocks, (c0, c1, t0, t1)
    assert len({id(t) for _, t in tables}) == len({len(t) for _, t in tables})   # one tuple per block count


def test_a_replaced_block_gives_a_new_table():
    req = make_request("a", 8)
    req.set_blocks([3, 4])
    t = req.block_table
    assert req.block_table is t
    req.replace_block(1, 9)
    assert req.block_table == (3, 9) and req.block_table is not t
    t = req.block_table
    req.add_blocks([5])
    assert req.block_table == (3, 9, 5)
    copy = dataclasses.replace(req, block_ids=[7])      # a copy never inherits the cached tuple
    assert copy.block_table == (7,) and req == dataclasses.replace(req)
    req.set_blocks([])
    assert req.block_table == ()


def test_forks_preemption_and_a_shared_prefix_keep_tables_true():
    # a fork copies its parent's partly filled block on write, a pool this small preempts, equal
    # prompts dedupe in the prefix cache: check_invariants (in drive) compares every live table
    # with its blocks, and the fake runner reads each context back through the step's table
    for one_step_ahead in (False, True):
        sched = Scheduler(_config(num_blocks=13, max_model_len=64, max_num_batched_tokens=32,
                                  enable_prefix_caching=True))
        runner = FakeRunner(13, 4)
        prompt = [5, 6, 7, 8, 9, 10]
        reqs = [make_request(f"r{i}", prompt + [3 + i % 2], max_tokens=20, ignore_eos=True) for i in range(4)]
        for r in reqs:
            sched.add_request(r)
        child = make_request("fork", prompt + [3], max_tokens=20, ignore_eos=True)
        sched.fork_request("r0", child)
        drive(sched, runner=runner, one_step_ahead=one_step_ahead)
        assert_outputs_match_reference(reqs + [child], 64)
        assert sched.stats().num_preemptions > 0 and runner.num_copies > 0


def test_the_runner_follows_a_table_it_was_given_once():
    shapes = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(1, 4, 16),
                          prefill_buckets=(0, 1, 2, 4, 8, 16, 32), decode_only_buckets=(1, 2, 4, 8, 16))
    sched = Scheduler(_config(num_blocks=24, enable_prefix_caching=True))
    runner, batch = FakeRunner(24, 4), PersistentBatch(shapes, mask_words=0)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", [5, 6, 7, 8, 9] + [i % 3] * 4, max_tokens=10))
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        if out.requests:
            got, want = batch.pack(out), pack_step(out, shapes, mask_words=0)
            for k in ("dec_tables", "pre_tables"):
                np.testing.assert_array_equal(got.arrays[k], want.arrays[k], err_msg=f"step {steps}: {k}")
        sched.update(out, runner.execute(out, sched))
        steps += 1
    assert steps > 10
