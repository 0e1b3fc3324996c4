"""Each kernel lowers for CUDA (an H200) on this CPU machine, so GPU-only shape rules fail here.

Lowering runs jax's own checks for the target: Triton's power-of-two tensors, Mosaic GPU's
bulk-copy alignment (multiples of 128 bytes), wgmma operand shapes, swizzles and register
layouts. It does not run ptxas, so shared-memory and register budgets are checked only on a GPU
(scripts/gpu_check.sh). The last two tests show the harness does catch such mistakes.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_cross_lower import export_for_cuda
from pallas_kernel_cases import case, make_inputs, with_options
from pallas_kernels.ragged_paged_attention_mosaic import ragged_paged_attention_mosaic
from pallas_kernels.ragged_paged_attention_triton import ragged_paged_attention_triton

OPTIONS = ("sm_scale", "sliding_window", "soft_cap")


def export(kernel, c, **kw):
    inputs = make_inputs(c)
    options = {k: inputs.pop(k) for k in OPTIONS}
    exported = export_for_cuda(functools.partial(kernel, **options, **kw), *inputs.values())
    return exported.mlir_module()


@pytest.mark.parametrize("c", [
    case("mixed", group=3, head_dim=64, dtype="bfloat16", sliding_window=20, soft_cap=30.0),
    with_options(case("decode", group=8, head_dim=128, dtype="float16"), block_size=64, width=1,
                 kv_lens=(1, 16, 64, 33), num_blocks=8),
    with_options(case("prefill", group=4, head_dim=128, dtype="bfloat16"), block_size=32, width=2,
                 num_blocks=8),
    with_options(case("mixed", group=1, head_dim=64, dtype="float16"), block_size=128, width=1,
                 num_blocks=6),
], ids=lambda c: c.label())
def test_mosaic_kernel_lowers_for_h200(c):
    text = export(ragged_paged_attention_mosaic, c, num_splits=2)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("c", [
    case("mixed", group=3, head_dim=64, dtype="bfloat16", sliding_window=20, soft_cap=30.0),
    case("decode", group=8, head_dim=128, dtype="float32"),
    with_options(case("prefill", group=1, head_dim=128, dtype="float16"), block_size=32, width=2,
                 num_blocks=8),
], ids=lambda c: c.label())
def test_triton_kernel_lowers_for_cuda(c):
    text = export(ragged_paged_attention_triton, c, num_splits=2)
    assert "xla.gpu.triton" in text


def test_lowering_rejects_a_triton_block_that_is_not_a_power_of_two():
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[pl.ds(0, 3), :] * 2.0           # 3 rows: not a power of two

    fn = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((3, 16), x.dtype))(x)  # noqa: E731
    with pytest.raises(Exception, match="power of 2"):
        export_for_cuda(fn, jnp.zeros((8, 16), jnp.float32))


def test_lowering_rejects_a_bulk_copy_whose_rows_are_not_a_multiple_of_128_bits():
    def body(x_ref, o_ref, smem, bar):
        plgpu.copy_gmem_to_smem(x_ref, smem, bar)        # rows of 4 x 16 bits: TMA wants 128-bit multiples
        plgpu.barrier_wait(bar)
        plgpu.copy_smem_to_gmem(smem, o_ref)
        plgpu.wait_smem_to_gmem(0)

    fn = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 4), jnp.bfloat16),
                      scratch_types=(plgpu.SMEM((8, 4), jnp.bfloat16), plgpu.Barrier()),
                      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    with pytest.raises(Exception, match="128"):
        export_for_cuda(fn, jnp.zeros((8, 4), jnp.bfloat16))


@pytest.mark.parametrize("kernel", [ragged_paged_attention_mosaic, ragged_paged_attention_triton],
                         ids=["mosaic", "triton"])
def test_kernels_lower_at_serving_shapes(kernel):
    # A Llama-3-8B layer in a 512-token bucket of up to 256 sequences, 16k-token block tables;
    # shapes only, so nothing this size is allocated.
    t, s, w, blocks = 512, 256, 1024, 65536
    spec = jax.ShapeDtypeStruct
    args = (spec((t, 32, 128), jnp.bfloat16), spec((blocks, 16, 8, 128), jnp.bfloat16),
            spec((blocks, 16, 8, 128), jnp.bfloat16), spec((s,), jnp.int32), spec((s, w), jnp.int32),
            spec((s + 1,), jnp.int32), spec((1,), jnp.int32))
    exported = export_for_cuda(functools.partial(kernel, sm_scale=0.088), *args)
    assert exported.out_avals[0].shape == (t, 32, 128)
