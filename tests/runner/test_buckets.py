"""Step buckets: decode-only steps pick from a finer list than steps that carry prefill tiles."""

import numpy as np
import pytest

from jaxserve.engine_args import engine_config
from jaxserve.engine.builder import runner_shapes
from jaxserve.runner.batch import batch_shapes
from tests.packing_oracle import pack_step
from jaxserve.runner.buckets import RunnerShapes, default_decode_only_buckets
from jaxserve.sched.scheduler_output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput

SHAPES = RunnerShapes(block_size=4, max_model_len=64, prefill_tile=8, decode_buckets=(1, 4, 16),
                      prefill_buckets=(0, 1, 2), decode_only_buckets=(1, 2, 4, 6, 8, 12, 16))


def test_default_decode_only_buckets():
    assert default_decode_only_buckets(32) == (1, 2, 4, 6, 8, 12, 16, 24, 32)
    assert default_decode_only_buckets(100)[-3:] == (64, 96, 100)
    assert default_decode_only_buckets(1) == (1,)
    assert default_decode_only_buckets(5) == (1, 2, 4, 5)


@pytest.mark.parametrize("max_num_seqs", [1, 7, 32, 100, 256])
def test_a_decode_only_step_pads_less_than_a_third_of_its_rows(max_num_seqs):
    shapes = RunnerShapes(4, 64, 8, (max_num_seqs,), (0, 1), default_decode_only_buckets(max_num_seqs))
    for n in range(1, max_num_seqs + 1):
        rows, tiles = shapes.pick(n, 0)
        assert tiles == 0 and n <= rows and (rows - n) * 3 < rows, (n, rows)


def test_decode_only_and_mixed_steps_pick_from_their_own_lists():
    assert SHAPES.pick(5, 0) == (6, 0)
    assert SHAPES.pick(5, 1) == (16, 1)
    assert SHAPES.pick(0, 2) == (1, 2)
    assert SHAPES.pick(13, 0) == (16, 0)
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        SHAPES.pick(17, 0)


def test_compiled_buckets_are_the_fine_decode_only_list_plus_the_coarse_mixed_grid():
    buckets = SHAPES.buckets()
    assert [b for b in buckets if b[1] == 0] == [(d, 0) for d in (1, 2, 4, 6, 8, 12, 16)]
    assert [b for b in buckets if b[1] > 0] == [(1, 1), (1, 2), (4, 1), (4, 2), (16, 1), (16, 2)]
    assert SHAPES.max_decode_rows == 16
    # without a fine list, decode-only steps use the coarse one
    coarse = RunnerShapes(4, 64, 8, (1, 4, 16), (0, 1, 2))
    assert coarse.pick(5, 0) == (16, 0) and len(coarse.buckets()) == 9


def _decode(i: int, context: int) -> ScheduledRequest:
    return ScheduledRequest(f"r{i}", (7,), context, tuple(range(1, 1 + context // 4 + 1)), True, 0)


def test_pack_step_uses_the_fine_bucket_for_a_decode_only_step():
    packed = pack_step(SchedulerOutput(tuple(_decode(i, 9) for i in range(5)), 5), SHAPES)
    assert packed.bucket == (6, 0)
    expected = batch_shapes(6, 0, tile=SHAPES.prefill_tile, table_width=SHAPES.table_width)
    assert {k: v.shape for k, v in packed.arrays.items()} == {k: s for k, (s, _) in expected.items()}
    assert packed.arrays["dec_num"].tolist() == [5]
    np.testing.assert_array_equal(packed.arrays["dec_kv_lens"], [10] * 5 + [0])


def test_engine_config_sets_the_decode_only_list():
    default = runner_shapes(engine_config(max_num_seqs=32), 512)
    assert default.decode_buckets == (1, 4, 16, 32)
    assert default.decode_only_buckets == (1, 2, 4, 6, 8, 12, 16, 24, 32)
    # pinned decode_buckets serve decode-only steps too unless decode_only_buckets is given
    pinned = runner_shapes(engine_config(max_num_seqs=8, decode_buckets=(8,)), 512)
    assert pinned.decode_only_buckets == (8,)
    both = runner_shapes(engine_config(max_num_seqs=8, decode_buckets=(8,), decode_only_buckets=(2, 8)), 512)
    assert both.buckets()[:2] == [(2, 0), (8, 0)]
    with pytest.raises(ValueError, match="decode_only_buckets=.* must reach max_num_seqs=8"):
        runner_shapes(engine_config(max_num_seqs=8, decode_only_buckets=(1, 4)), 512)
    with pytest.raises(ValueError, match="decode_only_buckets"):
        engine_config(decode_only_buckets=(4, 2))


def test_a_placeholder_reads_the_previous_steps_row_and_other_rows_read_their_ids():
    decode = ScheduledRequest("a", (PLACEHOLDER_TOKEN,), 9, (1, 2, 3), True, 1)
    chunk = ScheduledRequest("b", (4, 5, PLACEHOLDER_TOKEN), 8, (4, 5, 6), True, 1)
    fresh = _decode(7, 9)
    packed = pack_step(SchedulerOutput((decode, fresh, chunk), 5), SHAPES, prev_rows={"a": 3, "b": 0})
    D = packed.bucket[0]
    src, ids = packed.arrays["token_src"], packed.arrays["input_ids"]
    assert src[0] == 3 and src[1] == -1 and ids[1] == 7
    assert src[D:D + 3].tolist() == [-1, -1, 0] and ids[D:D + 2].tolist() == [4, 5]
    assert (src[D + 3:] == -1).all() and (src[2:D] == -1).all()


def test_a_placeholder_without_a_previous_sample_is_refused():
    with pytest.raises(ValueError, match="placeholder"):
        pack_step(SchedulerOutput((ScheduledRequest("a", (PLACEHOLDER_TOKEN,), 9, (1, 2, 3), True, 1),), 1), SHAPES,
                  prev_rows={})
