"""Each quantized form against its dequantized float reference, on random weights.

The references are computed in float64 numpy from `dequantize` (the values the quantized tensor
stands for), so what is compared is only the compiled matmul's own arithmetic. Its error bound:
a float32 dot of n terms is off by at most about n * 2^-24 * sum_i |x_i w_i| (the classic
gamma_n bound), and the scale multiply adds one more rounding; the tolerance is twice that, per
output element. A wrong group, nibble order, transposition or scale axis is off by O(|x| |w|).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.quantized_tensor import QuantizedTensor, flatten, unflatten
from jaxserve.models.linear import matmul
from jaxserve.models.params import quantized_leaves
from jaxserve.quant.dequantize import dequantize
from jaxserve.quant.fp8 import E4M3_MAX, quantize_fp8
from jaxserve.quant.int4 import pack_nibbles, quantize_int4, unpack_nibbles
from jaxserve.quant.int8 import quantize_int8

OUT, IN, T = 48, 256, 5
RNG = np.random.default_rng(0)
W = RNG.normal(0, 0.05, (OUT, IN)).astype(np.float32)
X = RNG.normal(0, 1.0, (T, IN)).astype(np.float32)

FORMS = {
    "int8": lambda w: quantize_int8(w),
    "int8_group32": lambda w: quantize_int8(w, 32),
    "int4_g32": lambda w: quantize_int4(w, 32),
    "int4_g128": lambda w: quantize_int4(w, 128),
    "int4_g32_symmetric": lambda w: quantize_int4(w, 32, symmetric=True),
    "fp8_calibrated": lambda w: quantize_fp8(w, float(np.abs(X).max())),
    "fp8_uncalibrated": lambda w: quantize_fp8(w, None),
}


def _run(t: QuantizedTensor, x: np.ndarray, dtype=jnp.float32) -> np.ndarray:
    leaves = quantized_leaves([t], dtype)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    fn = jax.jit(lambda x, p: matmul(x, p, dtype, precision))
    return np.asarray(fn(jnp.asarray(x, dtype), leaves), np.float64)


def _activations(t: QuantizedTensor, x: np.ndarray) -> np.ndarray:
    """What the dot sees of x: itself, or for fp8 its e4m3 rounding after the activation scale."""
    if t.kind != "fp8":
        return x.astype(np.float64)
    act = 1.0 if t.act_scale is None else t.act_scale
    xq = np.clip(x / np.float32(act), -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return xq.astype(np.float64) * act


@pytest.mark.parametrize("form", sorted(FORMS))
def test_quantized_matmul_equals_its_dequantized_reference(form):
    t = FORMS[form](W)
    got = _run(t, X)
    xs = _activations(t, X)
    w = dequantize(t).astype(np.float64)                                  # [out, in]
    want = xs @ w.T
    bound = 2 * IN * 2.0 ** -24 * (np.abs(xs) @ np.abs(w).T) + 1e-30
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)
    # and the form is a real approximation of the float weight (catches a scale on the wrong axis)
    assert np.abs(X @ W.T - got).max() < 0.25 * np.abs(X @ W.T).max()


def test_bfloat16_compute_stays_close_to_the_reference():
    t = quantize_int8(W)
    got = _run(t, X, jnp.bfloat16)
    want = X.astype(np.float64) @ dequantize(t).astype(np.float64).T
    # bf16 inputs (8-bit mantissa): relative error about 2^-8 per product, float32 accumulation
    assert np.abs(got - want).max() <= 2 ** -7 * (np.abs(X) @ np.abs(dequantize(t)).T).max()


@pytest.mark.parametrize("group", [32, 128])
def test_nibbles_pack_and_unpack_in_llama_cpp_order(group):
    q = RNG.integers(0, 16, (3, 256)).astype(np.uint8)
    packed = pack_nibbles(q, group)
    assert packed.shape == (3, 128)
    np.testing.assert_array_equal(unpack_nibbles(packed, group), q)
    # byte j of a group: element j low, element j + group/2 high (Q4_0 / Q4_1 block order)
    assert packed[0, 1] == q[0, 1] | (q[0, 1 + group // 2] << 4)


@pytest.mark.parametrize("form", ["int8", "int8_group32", "int4_g32", "int4_g128", "int4_g32_symmetric"])
def test_rounding_error_is_at_most_half_a_step(form):
    t = FORMS[form](W)
    err = np.abs(dequantize(t) - W).reshape(OUT, -1, t.group)
    assert np.all(err <= t.scale[..., None] * 0.5 * (1 + 1e-5))


def test_fp8_weights_keep_e4m3_relative_precision():
    t = quantize_fp8(W, None)
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4 for normals; subnormals (below
    # 2^-6 of the row's scaled range) are off by at most half their spacing, 2^-10 x scale
    err = np.abs(dequantize(t) - W)
    assert np.all(err <= 2 ** -4 * np.abs(W) + 2 ** -10 * t.scale)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_flatten_round_trips(form):
    t = FORMS[form](W)
    back = unflatten(flatten({"a.weight": t, "b": np.ones(3, np.float32)}))
    np.testing.assert_array_equal(back["b"], np.ones(3))
    np.testing.assert_array_equal(dequantize(back["a.weight"]), dequantize(t))
    assert back["a.weight"].act_scale == t.act_scale and back["a.weight"].kind == t.kind
