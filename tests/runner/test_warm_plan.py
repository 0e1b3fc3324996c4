"""The background warm-up's plan: the first set serves every seat, the order after it, the cap
each warm set allows (checked against every step the cap admits: some warm bucket holds it, as
the runner's pick finds it), and how readiness follows marks. Pure host code: no model."""

import itertools

import pytest

from jaxserve.runner.buckets import RunnerShapes, default_decode_buckets, default_decode_only_buckets, \
    default_prefill_buckets
from jaxserve.runner.warm_plan import BucketReadiness, buckets_under, coverage_cap, warm_plan
from jaxserve.sched.step_cap import StepCap

SHAPES = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(1, 4, 16),
                      prefill_buckets=(0, 1, 2, 4, 8), decode_only_buckets=(1, 2, 4, 6, 8, 12, 16))
DEFAULT = RunnerShapes(block_size=16, max_model_len=8192, prefill_tile=8, decode_buckets=default_decode_buckets(32),
                       prefill_buckets=default_prefill_buckets(64), decode_only_buckets=default_decode_only_buckets(32))
EIGHT = RunnerShapes(block_size=16, max_model_len=8192, prefill_tile=8, decode_buckets=default_decode_buckets(8),
                     prefill_buckets=default_prefill_buckets(64), decode_only_buckets=default_decode_only_buckets(8))


def _every_step(shapes, seats, tiles):
    """(decode rows, prefill tiles) of every step of d <= seats decode rows and p <= tiles tiles."""
    return [(d, p) for d, p in itertools.product(range(seats + 1), range(tiles + 1)) if d or p]


@pytest.mark.parametrize("shapes", [SHAPES, DEFAULT])
def test_buckets_under_a_cap_are_exactly_those_its_steps_pick(shapes):
    top_seats, top_tiles = shapes.max_decode_rows, shapes.prefill_buckets[-1]
    for seats in range(1, top_seats + 1):
        for tiles in (1, 2, 3, 4, 5, 8, top_tiles):
            if tiles <= top_tiles:
                picked = {shapes.pick(d, p) for d, p in _every_step(shapes, seats, tiles)}
                assert buckets_under(shapes, seats, tiles) == picked, (seats, tiles)


@pytest.mark.parametrize("shapes,seats,tokens", [(SHAPES, 16, 64), (DEFAULT, 32, 512), (EIGHT, 8, 512),
                                                 (SHAPES, 4, 32)])
def test_every_warm_set_along_the_plan_holds_every_step_its_cap_admits(shapes, seats, tokens):
    plan = warm_plan(shapes, max_num_seqs=seats, max_num_batched_tokens=tokens)
    tiles = tokens // shapes.prefill_tile
    assert sorted(plan.buckets) == sorted(buckets_under(shapes, seats, tiles))
    assert len(plan.buckets) == len(set(plan.buckets))
    # at ready every seat is served, with a tile of prompt beside the full seats' decodes
    first_cap = coverage_cap(shapes, frozenset(plan.first), seats, tiles)
    assert len(plan.first) == 2 and first_cap.seats == seats
    assert first_cap.tokens >= seats + shapes.prefill_tile
    warm = set()
    for bucket in plan.buckets:
        warm.add(bucket)
        if len(warm) < len(plan.first):
            continue
        cap = coverage_cap(shapes, frozenset(warm), seats, tiles)
        bound = (seats, tiles) if cap is None else (cap.seats, cap.tokens // shapes.prefill_tile)
        for d, p in _every_step(shapes, *bound):
            if p and d + p * shapes.prefill_tile > bound[1] * shapes.prefill_tile:
                continue     # more tokens than the cap: the scheduler never makes the step
            got = shapes.pick(d, p, frozenset(warm))
            assert got in warm and got[0] >= d and got[1] >= p, (warm, d, p, got)
    assert coverage_cap(shapes, frozenset(warm), seats, tiles) is None


def test_the_plan_warms_small_decode_steps_then_larger_prompt_chunks_then_tighter_fits():
    plan = warm_plan(EIGHT, max_num_seqs=8, max_num_batched_tokens=512)
    assert len(plan.buckets) == 26 and plan.first == ((8, 0), (8, 2))
    assert plan.rest[:4] == ((1, 0), (2, 0), (4, 0), (6, 0))
    assert plan.rest[4:9] == ((8, 4), (8, 8), (8, 16), (8, 32), (8, 64))
    caps = []
    warm = set(plan.first)
    for b in plan.rest[:9]:
        warm.add(b)
        caps.append(coverage_cap(EIGHT, frozenset(warm), 8, 64))
    assert [c.tokens for c in caps[:4]] == [16] * 4 and caps[-1] is None
    assert [c.tokens for c in caps[4:8]] == [32, 64, 128, 256]
    # the rest save padding only: warmed while no request is live
    assert plan.when_idle == frozenset(plan.rest[9:]) and (8, 1) in plan.when_idle
    assert all(d < 8 or p < 2 for d, p in plan.when_idle)


def test_the_default_configuration_turns_ready_after_2_of_its_37_buckets():
    plan = warm_plan(DEFAULT, max_num_seqs=32, max_num_batched_tokens=512)
    assert len(plan.buckets) == 37 and plan.first == ((32, 0), (32, 8))


def test_a_warm_step_runs_in_the_cheapest_warm_bucket_that_holds_it():
    warm = frozenset({(8, 0), (8, 2), (2, 0)})
    assert EIGHT.pick(1, 0, warm) == (2, 0)        # (1, 0) is cold: the next warm size up
    assert EIGHT.pick(3, 0, warm) == (8, 0)
    assert EIGHT.pick(3, 1, warm) == (8, 2)        # a 1-tile chunk beside 3 decodes, padded
    assert EIGHT.pick(3, 1, None) == (4, 1)        # everything warm: the exact bucket
    assert EIGHT.pick(3, 4, warm) == (4, 4)        # none holds it: the exact one (the cap prevents this)
    with pytest.raises(RuntimeError, match="no warm bucket"):
        coverage_cap(EIGHT, frozenset({(1, 0)}), 8, 64)


def test_readiness_follows_each_mark_and_tells_the_runner_and_the_scheduler():
    plan = warm_plan(SHAPES, max_num_seqs=16, max_num_batched_tokens=64)
    changes = []
    r = BucketReadiness(plan, SHAPES, on_change=lambda warm, cap: changes.append((warm, cap)))
    with pytest.raises(RuntimeError):
        r.cap                                      # nothing warm: no step may run
    r.mark_ready(plan.first)
    assert r.cap == StepCap(16, 32) and changes[-1] == (frozenset(plan.first), r.cap)
    r.mark_ready(plan.first)                       # nothing new: nobody is told
    assert len(changes) == 1
    assert r.pending() == list(plan.rest) and r.warm == frozenset(plan.first)
    r.mark_ready(r.pending())
    assert r.all_ready and r.cap is None and r.warm is None and changes[-1] == (None, None)
    assert r.num_ready == r.total and r.wait_all(0)


def test_serving_mode_warms_everything_but_the_padding_only_buckets_before_ready():
    plan = warm_plan(EIGHT, max_num_seqs=8, max_num_batched_tokens=512)
    serving = plan.serving_first()
    assert set(serving.first) == set(plan.buckets) - plan.when_idle
    assert set(serving.rest) == set(serving.when_idle) == plan.when_idle
    assert coverage_cap(EIGHT, frozenset(serving.first), 8, 64) is None   # no cap from the first step
