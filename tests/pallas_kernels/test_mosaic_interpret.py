"""The Mosaic GPU kernel, run by the Mosaic GPU interpreter on the CPU, against the reference.

The interpreter simulates SMEM (initialised to NaN), bulk copies, barriers and wgmma, and raises
on out-of-bounds reads, so a missing wait or a stray page shows here. Every ref operation is a
host callback: cases stay tiny and use one split unless the split itself is under test.
"""

import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races  # no public name in 0.11
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernel_cases import (
    assert_matches_reference, case, full_grid, make_inputs, random_batches, reference, with_options,
)
from pallas_kernels.ragged_paged_attention_mosaic import (
    ragged_paged_attention_mosaic,
    unsupported_reason,
)

# A pairwise cover of kind x group x head dim x 16-bit dtype x block size, plus the options.
CI_CASES = [   # one KV head where a second adds only interpreter time; two where head indexing is tested
    case("decode", group=1, head_dim=64, dtype="bfloat16"),
    case("prefill", group=3, head_dim=128, dtype="float16", num_kv_heads=1, seed=1),
    case("mixed", group=4, head_dim=64, dtype="bfloat16", sliding_window=20, num_kv_heads=1, seed=2),
    case("mixed", group=8, head_dim=128, dtype="float16", soft_cap=3.0, num_kv_heads=1, seed=3),
    # Pages larger than a tile: each 64-key tile is a slice of one 128-token page.
    with_options(case("prefill", group=4, head_dim=64, dtype="bfloat16", seed=4), block_size=128,
                 width=1, num_blocks=4),
    with_options(case("decode", group=3, head_dim=64, dtype="float16", num_kv_heads=1, seed=5),
                 block_size=32, width=2, num_blocks=10),
]


def run(c, **kw):
    inputs = make_inputs(c)
    want = reference(**inputs)
    got = ragged_paged_attention_mosaic(**inputs, **{"interpret": True, **kw})
    assert_matches_reference(got, want, c)


@pytest.mark.parametrize("c", CI_CASES, ids=lambda c: c.label())
def test_mosaic_kernel_matches_reference_in_interpreter(c):
    run(c)   # one split: the interpreted default


def test_flash_decoding_splits_merge_to_the_same_result_without_races():
    # Tiles of 64 keys: with 2 splits the longest sequences span both, the short ones leave one
    # empty. The interpreter's happens-before race detector watches every SMEM and GMEM access.
    c = with_options(case("decode", group=8, head_dim=64, dtype="bfloat16", seed=6),
                     kv_lens=(1, 64, 128, 65), width=8, num_blocks=24)
    run(c, num_splits=2, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not get_races().races_found


def test_float32_is_declined_so_dispatch_can_route_it_elsewhere():
    inputs = make_inputs(case("decode", group=1, head_dim=64, dtype="float32"))
    assert "bf16/f16" in unsupported_reason(inputs["q"], inputs["k_cache"])
    with pytest.raises(ValueError, match="bf16/f16"):
        ragged_paged_attention_mosaic(**inputs, interpret=True)


BLOCK_SIZES = [  # every way a tile is made of pages: 8 pages of 8, 2 of 32, 1 of 64, half of 128
    with_options(case("mixed", group=4, head_dim=128, dtype="bfloat16", seed=20 + bs), block_size=bs,
                 width=64 // bs + 1, num_blocks=4 * (64 // bs + 1) + 1)
    for bs in (8, 32, 64, 128)
]


@pytest.mark.full_grid
@pytest.mark.parametrize("c", full_grid(dtypes=("bfloat16", "float16")) + BLOCK_SIZES,
                         ids=lambda c: c.label())
def test_mosaic_kernel_full_grid(c):
    run(c)


def test_block_sizes_it_cannot_tile_are_declined():
    q = jnp.zeros((4, 2, 64), jnp.bfloat16)
    assert "block_size" in unsupported_reason(q, jnp.zeros((4, 24, 2, 64), jnp.bfloat16))
    assert "head_dim" in unsupported_reason(q[..., :32], jnp.zeros((4, 16, 2, 32), jnp.bfloat16))
    q256 = jnp.zeros((4, 2, 256), jnp.bfloat16)
    assert "head_dim" in unsupported_reason(q256, jnp.zeros((4, 16, 2, 256), jnp.bfloat16))


@pytest.mark.full_grid
def test_random_ragged_batches_match_reference():
    template = case("mixed", group=4, head_dim=64, dtype="bfloat16", sliding_window=24,
                    num_kv_heads=1, num_blocks=17)
    for c in random_batches(template, 6, seed=2):
        run(c)
