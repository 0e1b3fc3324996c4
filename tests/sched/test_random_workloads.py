"""Random workloads: whatever the configuration, arrivals and aborts, every request produces what
the model alone would produce, the block accounting holds after every step, and nothing leaks;
with the engine's one-step-ahead loop (step N+1 scheduled before step N's update) as without, and
with speculative decoding (n-gram guesses verified in decode-only steps) as without."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_testkit import (FakeRunner, assert_outputs_match_reference, drive, make_request, next_token,
                           short_memory_token)

from jaxserve.sched import Scheduler, SchedulerConfig
from jaxserve.sched.speculation import SpeculativeConfig
from jaxserve.sched.step_budget import ServiceObjectives
from jaxserve.sched.step_cost import StepCostModel


@st.composite
def slo_policies(draw, tile):
    """Service objectives with a made-up step-cost model (times in made-up seconds)."""
    buckets = sorted(set(draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=3))))
    tiles = sorted(set(draw(st.lists(st.sampled_from([1, 2, 4, 8, 16, 64]), min_size=1, max_size=3)) + [64]))
    cost = StepCostModel(
        decode_s=tuple((b, draw(st.floats(0.01, 0.3))) for b in buckets),
        prefill_s=tuple((t, 0.01 * t * draw(st.floats(0.5, 2.0))) for t in tiles),
        item_s=draw(st.floats(0.0, 0.01)), tile=tile, item_tokens=draw(st.sampled_from([4, 16])), calib_context=8)
    slo = ServiceObjectives(ttft_s=draw(st.floats(0.05, 2.0)), tpot_s=draw(st.floats(0.02, 0.5)))
    return slo, cost


@st.composite
def speculation(draw, max_num_seqs):
    """Speculative decoding settings, with made-up decode step times (or free rows)."""
    lo = draw(st.integers(1, 3))
    spec = SpeculativeConfig(num_speculative_tokens=draw(st.integers(1, 5)), prompt_lookup_min=lo,
                             prompt_lookup_max=draw(st.integers(lo, 4)),
                             prior_acceptance=draw(st.sampled_from([0.1, 0.5, 0.9])))
    max_rows = max_num_seqs + draw(st.integers(0, 12))
    rows = sorted(set(draw(st.lists(st.integers(1, max_rows), max_size=4))) | {max_rows})
    times = tuple((r, 0.01 + r * draw(st.floats(0.0, 0.02))) for r in rows) if draw(st.booleans()) else ()
    times = tuple(sorted(times))
    return dict(speculation=spec, max_decode_rows=max_rows, decode_step_seconds=times)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(8, 48))
    chunked = draw(st.booleans())
    granularity = draw(st.sampled_from([1, 1, 4]))
    longest = -(-(max_model_len - 1) // granularity) * granularity
    budget = draw(st.integers(1, 64)) if chunked else draw(st.integers(max(max_model_len, longest), longest + 16))
    need_blocks = -(-max_model_len // block_size)
    mode = draw(st.sampled_from(["recompute", "swap", "auto"]))
    max_num_seqs = draw(st.integers(1, 6))
    caching = draw(st.booleans())
    offload = caching and draw(st.booleans())   # the prefix cache's host tier
    cfg = SchedulerConfig(
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_num_partial_prefills=draw(st.integers(0, 2)),
        starvation_steps=draw(st.integers(1, 10)),
        kv_watermark=draw(st.sampled_from([0.0, 0.1])),
        admission_output_share=draw(st.sampled_from([0.0, 0.5, 1.0])),
        preemption_mode=mode,
        num_host_blocks=0 if mode == "recompute" and not offload else draw(st.integers(1, 2 * need_blocks)),
        enable_kv_offload=offload,
        swap_crossover_tokens=draw(st.integers(0, 16)),
        num_blocks=1 + draw(st.integers(need_blocks, 2 * need_blocks)),
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.integers(0, 8)) if chunked else 0,
        chunk_granularity=granularity,
        enable_prefix_caching=caching,
        **(dict(zip(("objectives", "step_cost"), draw(slo_policies(granularity))))
           if chunked and draw(st.booleans()) else {}),
        **(draw(speculation(max_num_seqs)) if draw(st.booleans()) else {}),
    )
    shared = draw(st.lists(st.integers(3, 63), min_size=0, max_size=12))  # a common prefix
    arrivals: dict[int, list] = {}
    for i in range(draw(st.integers(1, 10))):
        own = draw(st.lists(st.integers(3, 63), min_size=1, max_size=20))
        prompt = (shared + own)[: max_model_len - 1]
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        req = make_request(
            f"r{i}",
            prompt,
            max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=frozenset(draw(st.lists(st.integers(3, 63), max_size=2))),
            cache_salt=draw(st.sampled_from([None, None, "tenant"])),
            priority=draw(st.integers(0, 2)),
        )
        arrivals.setdefault(draw(st.integers(0, 12)), []).append(req)
    aborts = draw(st.dictionaries(st.integers(0, 30), st.sampled_from([f"r{i}" for i in range(10)]), max_size=2))
    # forks: at a step, a child continuing some live request's tokens (a sample or a beam)
    forks = draw(
        st.dictionaries(
            st.integers(0, 30),
            st.tuples(st.integers(0, 9), st.lists(st.integers(3, 63), max_size=3), st.integers(1, 8)),
            max_size=3,
        )
    )
    model = draw(st.sampled_from([next_token, short_memory_token]))
    return cfg, arrivals, aborts, forks, model


@pytest.mark.parametrize("one_step_ahead", [False, True], ids=["sync", "one-step-ahead"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_match_the_model_alone_and_leak_no_blocks(one_step_ahead, w):
    cfg, arrivals, aborts, forks, model = w
    # time moves on from the requests' arrival (they were made just now), in no relation to the steps
    ticks, start = iter(range(1 << 30)), time.perf_counter()
    sched = Scheduler(cfg, clock=lambda: start + 0.01 * next(ticks))
    children = []
    # admission's memo of the running requests' growth (kept through one admission pass) equals
    # the projection computed afresh at every decision
    memoized, admission = sched.admission.running_growth, sched.admission

    def checked_growth(running):
        got = memoized(running)
        assert got == sum(max(0, admission.projected_blocks(r) - len(r.block_ids)) for r in running)
        return got

    admission.running_growth = checked_growth

    def on_step(step, out):
        if step in aborts:
            sched.abort_requests([aborts[step]])
        if step in forks:
            i, extra, max_tokens = forks[step]
            parent = sched.get_request(f"r{i}")
            if parent is not None:
                prompt = (parent.all_token_ids + extra)[: cfg.max_model_len - 1]
                child = make_request(f"fork{step}", prompt, min(max_tokens, cfg.max_model_len - len(prompt)),
                                     cache_salt=parent.cache_salt)
                sched.fork_request(parent.request_id, child)
                children.append(child)

    reqs = drive(sched, arrivals=arrivals, on_step=on_step, one_step_ahead=one_step_ahead,
                 runner=FakeRunner(cfg.num_blocks, cfg.block_size, model), speculate=cfg.speculation is not None)
    assert_outputs_match_reference(list(reqs.values()) + children, cfg.max_model_len, model)
    for r in list(reqs.values()) + children:
        assert r.is_finished and not r.block_ids
