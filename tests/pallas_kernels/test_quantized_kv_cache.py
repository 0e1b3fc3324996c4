"""A quantized KV cache (fp8_e4m3 / int8, per-KV-head scales) read by every implementation.

The expected output is the reference over the DEQUANTIZED cache in float32: quantization's own
error is not under test here, only that each implementation reads the stored elements, widens
them and applies the scales exactly as `dequantize_kv` says (kv_quant.py folds the scales into
q and the output). So the float32 tolerance of the kernel cases applies. Unused pages hold NaN
in the fp8 case (e4m3 has a NaN): a stray read still shows.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernel_cases import assert_matches_reference, case, make_inputs, reference
from pallas_kernels.kv_quant import dequantize_kv, quantize_kv, with_kv_scales
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_triton import ragged_paged_attention_triton
from pallas_kernels.ragged_paged_attention_xla import ragged_paged_attention_xla


def _quantized_inputs(c, kv_dtype):
    inputs = make_inputs(c)
    k, v = inputs["k_cache"], inputs["v_cache"]                        # float32, NaN where unused
    kk = c.num_kv_heads
    rng = np.random.default_rng(c.seed)
    # per-head scales that differ by 10x between heads, so a scale on the wrong head shows
    k_scale = jnp.asarray(np.nanmax(np.abs(np.asarray(k)), axis=(0, 1, 3)) / 100 * rng.uniform(0.5, 5, kk),
                          jnp.float32)
    v_scale = jnp.asarray(np.nanmax(np.abs(np.asarray(v)), axis=(0, 1, 3)) / 100 * rng.uniform(0.5, 5, kk),
                          jnp.float32)
    shape = k.shape
    kq = quantize_kv(k.reshape(-1, kk, shape[-1]), k_scale, kv_dtype).reshape(shape)
    vq = quantize_kv(v.reshape(-1, kk, shape[-1]), v_scale, kv_dtype).reshape(shape)
    want = reference(**{**inputs, "k_cache": dequantize_kv(kq, k_scale), "v_cache": dequantize_kv(vq, v_scale)})
    return {**inputs, "k_cache": kq, "v_cache": vq}, k_scale, v_scale, want


IMPLEMENTATIONS = {
    "reference": ragged_paged_attention_reference,
    "xla": ragged_paged_attention_xla,
    "triton_interpret": lambda *a, **kw: ragged_paged_attention_triton(*a, **kw, interpret=True),
}


@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_implementations_read_a_quantized_cache(impl, kv_dtype, kind):
    c = case(kind, group=4, head_dim=64, dtype="float32", seed=11)
    inputs, k_scale, v_scale, want = _quantized_inputs(c, jnp.dtype(kv_dtype))
    got = with_kv_scales(IMPLEMENTATIONS[impl], k_scale, v_scale)(**inputs)
    assert_matches_reference(got, want, c)
    # and the cache really is one byte per element
    assert inputs["k_cache"].dtype.itemsize == 1


def test_quantization_error_is_within_half_a_step():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 2, 16)), jnp.float32)
    scale = jnp.asarray([0.02, 0.03], jnp.float32)
    back = dequantize_kv(quantize_kv(x, scale, jnp.int8), scale)
    assert np.all(np.abs(np.asarray(back - x)) <= np.asarray(scale)[None, :, None] * 0.5 + 1e-7)
    fp8 = dequantize_kv(quantize_kv(x, scale, jnp.float8_e4m3fn), scale)
    assert np.all(np.abs(np.asarray(fp8 - x)) <= 2 ** -4 * np.abs(np.asarray(x)) + 2 ** -10 * np.asarray(scale)[None, :, None])


def test_mosaic_declines_a_quantized_cache():
    from pallas_kernels.ragged_paged_attention_mosaic import unsupported_reason

    q = jnp.zeros((4, 8, 64), jnp.bfloat16)
    assert unsupported_reason(q, jnp.zeros((4, 16, 2, 64), jnp.float8_e4m3fn)) is not None
