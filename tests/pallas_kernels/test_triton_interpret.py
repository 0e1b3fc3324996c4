"""The Triton-backend kernel, run by Pallas' interpreter on the CPU, against the reference."""

import pytest

from pallas_kernel_cases import (
    assert_matches_reference, case, full_grid, make_inputs, random_batches, reference, with_options,
)
from pallas_kernels.ragged_paged_attention_triton import ragged_paged_attention_triton

# A pairwise cover of kind x group x head dim x dtype, plus the options, in few compiles.
CI_CASES = [
    case("decode", group=1, head_dim=64, dtype="float32"),
    case("prefill", group=3, head_dim=128, dtype="bfloat16", seed=1),
    case("mixed", group=4, head_dim=64, dtype="float16", sliding_window=20, seed=2),
    case("mixed", group=8, head_dim=128, dtype="float32", soft_cap=3.0, seed=3),
    case("decode", group=4, head_dim=128, dtype="bfloat16", seed=4),
    case("prefill", group=8, head_dim=64, dtype="float32", sliding_window=5, seed=5),
    with_options(case("mixed", group=3, head_dim=64, dtype="float16", seed=6), block_size=32, num_blocks=10),
]


def run(c, **kw):
    inputs = make_inputs(c)
    want = reference(**inputs)
    got = ragged_paged_attention_triton(**inputs, interpret=True, **kw)
    assert_matches_reference(got, want, c)


@pytest.mark.parametrize("c", CI_CASES, ids=lambda c: c.label())
def test_triton_kernel_matches_reference_in_interpreter(c):
    run(c)   # one split: the interpreted default


def test_flash_decoding_splits_merge_to_the_same_result():
    # 4 splits of at most 4 pages: some splits of the short sequences see no key at all.
    run(case("decode", group=4, head_dim=64, dtype="float32", sliding_window=40, seed=7), num_splits=4)


def test_narrow_query_tiles_match_reference():
    # The CI cases have more rows than sequences, so they run 64-row tiles; decode buckets use 16.
    run(case("mixed", group=3, head_dim=64, dtype="float32", seed=8), rows=16)


@pytest.mark.full_grid
@pytest.mark.parametrize("c", full_grid(), ids=lambda c: c.label())
def test_triton_kernel_full_grid(c):
    run(c)


def test_random_ragged_batches_match_reference():
    # One static shape, 16 random batches (decodes, chunks, empty padding slots), one compile.
    template = case("mixed", group=3, head_dim=64, dtype="float32", sliding_window=24,
                    num_blocks=17)
    for c in random_batches(template, 16, seed=1):
        run(c)
