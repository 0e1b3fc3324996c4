"""The background warm-up's padding-only buckets (the plan's `when_idle`) wait while requests are
live: serving keeps the cores. A fake runner records loads; the thread's waiting is observed by
its calls to `busy`, never timed."""

import threading
import time

from jaxserve.runner.background_warmup import BackgroundWarmUp
from jaxserve.runner.buckets import RunnerShapes, default_decode_buckets, default_decode_only_buckets, \
    default_prefill_buckets
from jaxserve.runner.warm_plan import BucketReadiness, warm_plan

SHAPES = RunnerShapes(block_size=16, max_model_len=8192, prefill_tile=8, decode_buckets=default_decode_buckets(8),
                      prefill_buckets=default_prefill_buckets(64), decode_only_buckets=default_decode_only_buckets(8))
GUARD_S = 120.0


class _LoadingRunner:
    def __init__(self):
        self.loaded: list[tuple[int, int]] = []

    def load_executables(self, buckets):
        self.loaded += list(buckets)


def _wait(condition, what):
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.005)


def test_padding_only_buckets_wait_for_an_idle_engine():
    plan = warm_plan(SHAPES, max_num_seqs=8, max_num_batched_tokens=512)
    readiness = BucketReadiness(plan, SHAPES)
    readiness.mark_ready(plan.first)
    live = threading.Event()
    live.set()
    polls = []

    def busy():
        polls.append(1)
        return live.is_set()

    runner = _LoadingRunner()
    warming = BackgroundWarmUp(runner, readiness, first_runs=False, busy=busy, idle_poll_s=0.001).start()
    try:
        needed = [b for b in plan.rest if b not in plan.when_idle]
        _wait(lambda: len(polls) >= 3, "the thread to poll a busy engine")
        assert runner.loaded == needed and readiness.cap is None     # the cap lifted under load
        assert not any(readiness.is_ready(b) for b in plan.when_idle)
        live.clear()                                                 # the engine goes idle
        assert warming.join(GUARD_S) and readiness.all_ready
        assert runner.loaded == list(plan.rest)
    finally:
        warming.stop(GUARD_S)
