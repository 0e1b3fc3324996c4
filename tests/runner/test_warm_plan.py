"""The background warm-up's plan: which buckets each stage's step cap can reach, checked against
every step the cap admits, and how readiness raises the cap. Pure host code: no model."""

import itertools

import pytest

from jaxserve.runner.buckets import RunnerShapes, default_decode_buckets, default_decode_only_buckets, \
    default_prefill_buckets
from jaxserve.runner.warm_plan import BucketReadiness, buckets_under, warm_stages
from jaxserve.sched.step_cap import StepCap

SHAPES = RunnerShapes(block_size=4, max_model_len=128, prefill_tile=8, decode_buckets=(1, 4, 16),
                      prefill_buckets=(0, 1, 2, 4, 8), decode_only_buckets=(1, 2, 4, 6, 8, 12, 16))
DEFAULT = RunnerShapes(block_size=16, max_model_len=8192, prefill_tile=8, decode_buckets=default_decode_buckets(32),
                       prefill_buckets=default_prefill_buckets(64), decode_only_buckets=default_decode_only_buckets(32))


def _every_step(shapes, seats, tiles):
    """The bucket of every step of d <= seats decode rows and p <= tiles prefill tiles."""
    return {shapes.pick(d, p) for d, p in itertools.product(range(seats + 1), range(tiles + 1)) if d or p}


@pytest.mark.parametrize("shapes", [SHAPES, DEFAULT])
def test_buckets_under_a_cap_are_exactly_those_its_steps_pick(shapes):
    top_seats, top_tiles = shapes.max_decode_rows, shapes.prefill_buckets[-1]
    for seats in range(1, top_seats + 1):
        for tiles in (1, 2, 3, 4, 5, 8, top_tiles):
            if tiles <= top_tiles:
                assert buckets_under(shapes, seats, tiles) == _every_step(shapes, seats, tiles), (seats, tiles)


@pytest.mark.parametrize("shapes,seats,tokens", [(SHAPES, 16, 64), (DEFAULT, 32, 512), (SHAPES, 4, 32)])
def test_stages_cover_every_bucket_once_and_each_cap_reaches_only_its_stages(shapes, seats, tokens):
    stages = warm_stages(shapes, max_num_seqs=seats, max_num_batched_tokens=tokens)
    buckets = [b for s in stages for b in s.buckets]
    assert sorted(buckets) == sorted(buckets_under(shapes, seats, tokens // shapes.prefill_tile))
    assert len(buckets) == len(set(buckets))
    assert stages[-1].cap is None and all(s.cap is not None for s in stages[:-1])
    so_far = set()
    for stage in stages:
        so_far |= set(stage.buckets)
        if stage.cap is not None:
            assert _every_step(shapes, stage.cap.seats, stage.cap.tokens // shapes.prefill_tile) <= so_far
    # a first request is served after a few buckets: one seat, a short chunk
    assert stages[0].cap == StepCap(1, shapes.prefill_tile) and len(stages[0].buckets) == 2


def test_the_default_configuration_turns_ready_after_2_of_its_37_buckets():
    stages = warm_stages(DEFAULT, max_num_seqs=32, max_num_batched_tokens=512)
    assert sum(len(s.buckets) for s in stages) == 37
    assert stages[0].buckets == ((1, 0), (1, 1))


def test_readiness_raises_the_cap_stage_by_stage_and_in_order():
    stages = warm_stages(SHAPES, max_num_seqs=16, max_num_batched_tokens=64)
    caps = []
    r = BucketReadiness(stages, on_cap=caps.append)
    with pytest.raises(RuntimeError):
        r.cap                                      # nothing warm: no step may run
    r.mark_ready(stages[0].buckets)
    assert r.cap == stages[0].cap and caps == [stages[0].cap]
    # a later stage complete before an earlier one raises nothing
    r.mark_ready(stages[2].buckets)
    assert r.cap == stages[0].cap and len(caps) == 1
    r.mark_ready(stages[1].buckets)
    assert r.cap == stages[2].cap and caps[-1] == stages[2].cap
    assert not r.all_ready and r.pending() == [b for s in stages[3:] for b in s.buckets]
    r.mark_ready(r.pending())
    assert r.all_ready and r.cap is None and caps[-1] is None and r.num_ready == r.total
    assert r.wait_all(0)
