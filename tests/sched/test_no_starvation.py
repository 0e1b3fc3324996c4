"""No starvation: under a steady stream of short, urgent requests that keeps the scheduler busy,
long prompts and background requests still finish, in bounded time, while the stream goes on."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_testkit import FakeRunner, check_drained, make_request

from jaxserve.sched import Scheduler, SchedulerConfig

STREAM_STEPS = 150


def run_stream(cfg, arrivals):
    """Drive the scheduler for STREAM_STEPS steps with `arrivals[step]`; return the step at which
    each request finished. Whatever is left at the end is aborted, and nothing may leak."""
    sched, runner = Scheduler(cfg), FakeRunner(cfg.num_blocks, cfg.block_size)
    finished_at = {}
    for step in range(STREAM_STEPS):
        for r in arrivals.get(step, []):
            sched.add_request(r)
        out = sched.schedule()
        for u in sched.update(out, runner.execute(out, sched)):
            if u.finished:
                finished_at[u.request.request_id] = step
    assert sched.stats().num_waiting > 0  # the stream really kept the scheduler saturated
    sched.abort_requests([r.request_id for r in list(sched.running) + list(sched.waiting)])
    check_drained(sched)
    return finished_at


def short_stream(rate, priority=0):
    """`rate` short requests (2-token prompts, 2 outputs) arriving every step of the stream."""
    return {
        s: [make_request(f"s{s}.{k}", 2, max_tokens=2, ignore_eos=True, priority=priority) for k in range(rate)]
        for s in range(STREAM_STEPS)
    }


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(4, 8),
    threshold=st.sampled_from([0, 4, 8]),
    partial=st.integers(0, 2),
    starvation=st.integers(1, 20),
    longs=st.lists(st.tuples(st.integers(0, 40), st.integers(20, 60)), min_size=1, max_size=3),
)
def test_long_prompts_finish_while_short_requests_keep_arriving(budget, threshold, partial, starvation, longs):
    cfg = SchedulerConfig(num_blocks=200, block_size=4, max_model_len=64, max_num_seqs=8,
                          max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                          max_num_partial_prefills=partial, starvation_steps=starvation)
    arrivals = short_stream(rate=3)  # more than the budget can serve: the queue keeps growing
    for i, (at, n) in enumerate(longs):
        arrivals[at].append(make_request(f"long{i}", n, max_tokens=2, ignore_eos=True))
    done = run_stream(cfg, arrivals)
    for i, (at, _) in enumerate(longs):
        assert done.get(f"long{i}", STREAM_STEPS) < STREAM_STEPS, f"long{i} (arrived at step {at}) waited for the stream to end"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from([2.0, 4.0]),
    background=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 2)), min_size=1, max_size=4),
)
def test_background_requests_finish_while_urgent_ones_keep_arriving(base, background):
    cfg = SchedulerConfig(num_blocks=200, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
                          scheduling_policy="priority", priority_weight_base=base)
    arrivals = short_stream(rate=3, priority=0)  # urgent load beyond capacity
    for i, (at, prio) in enumerate(background):
        arrivals[at].append(make_request(f"bg{i}", 6, max_tokens=3, ignore_eos=True, priority=prio))
    done = run_stream(cfg, arrivals)
    for i, (at, prio) in enumerate(background):
        assert done.get(f"bg{i}", STREAM_STEPS) < STREAM_STEPS, f"bg{i} (priority {prio}, arrived at {at}) starved"
