"""w8a8 (int8 weights x int8 activations per token, smoothed): the smoothing is exact before
rounding, the matmul computes exactly what its definition says, rows never see each other, and the
form survives a converted checkpoint's storage."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.quantized_tensor import QuantizedTensor, flatten, unflatten
from jaxserve.models.params import quantized_leaves
from jaxserve.models.linear import matmul
from jaxserve.quant.dequantize import dequantize
from jaxserve.quant.fuse import fuse_quantized
from jaxserve.quant.w8a8 import quantize_w8a8, smoothing


def _weights_and_ranges(rng, out=(48, 16), n=64):
    ws = [rng.standard_normal((o, n)).astype(np.float32) * 0.1 for o in out]
    act = np.abs(rng.standard_normal(n)).astype(np.float32) + 0.1
    act[[3, 17]] = 40.0                                        # two outlier channels, as LLMs have
    return ws, act


def test_smoothing_moves_range_into_the_weights_without_changing_the_product():
    rng = np.random.default_rng(0)
    ws, act = _weights_and_ranges(rng)
    m = smoothing(ws, act, alpha=0.8)
    assert m.shape == (64,) and np.all(m > 0)
    assert m[3] < np.median(m) and m[17] < np.median(m)          # outlier channels are scaled down most
    x = rng.standard_normal((5, 64)).astype(np.float32) * act
    for w in ws:
        np.testing.assert_allclose((x * m) @ (w / m).T, x @ w.T, rtol=1e-4, atol=1e-4)
    # alpha 0: no smoothing of the activations' ranges, only of the weights'
    np.testing.assert_allclose(smoothing(ws, act, alpha=0.0), np.max([np.abs(w).max(axis=0) for w in ws], axis=0),
                               rtol=1e-6)


def _reference(x: np.ndarray, t: QuantizedTensor) -> np.ndarray:
    """The definition, in numpy: x * act_smooth rounded per row to int8, times the int8 weight."""
    xs = x.astype(np.float64) * t.act_smooth
    row_scale = np.abs(xs).max(axis=1, keepdims=True) / 127.0
    row_scale[row_scale == 0] = 1.0
    xq = np.round(xs / row_scale)
    return (xq @ t.qweight.astype(np.float64).T) * row_scale * t.scale[:, 0]


@pytest.mark.parametrize("rows", [1, 2, 7])
def test_the_matmul_equals_its_definition_and_approximates_the_float_product(rows):
    rng = np.random.default_rng(rows)
    ws, act = _weights_and_ranges(rng)
    m = smoothing(ws, act)
    fused = fuse_quantized([quantize_w8a8(w, m) for w in ws])
    leaves = quantized_leaves([quantize_w8a8(w, m) for w in ws], jnp.float32)
    assert leaves["qweight"].shape == (64, 64) and leaves["act_smooth"].shape == (64,)
    x = (rng.standard_normal((rows, 64)) * act / 4).astype(np.float32)
    got = np.asarray(matmul(jnp.asarray(x), leaves, jnp.float32))
    np.testing.assert_allclose(got, _reference(x, fused), rtol=1e-5, atol=1e-5)
    want = x @ np.concatenate(ws).T
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()       # int8 on both sides: ~1% error
    # dequantize gives the weight the tensor stands for: what the matmul computes, but for the
    # rounding of the activations
    stands_for = x @ dequantize(fused).T
    assert np.abs(got - stands_for).max() < 0.02 * np.abs(stands_for).max()
    assert np.abs(got - stands_for).max() < np.abs(got - x @ (dequantize(fused) / fused.act_smooth).T).max()


def test_rows_are_quantized_alone_so_batching_changes_nothing():
    rng = np.random.default_rng(3)
    ws, act = _weights_and_ranges(rng, out=(32,))
    leaves = quantized_leaves([quantize_w8a8(ws[0], smoothing(ws, act))], jnp.float32)
    x = (rng.standard_normal((6, 64)) * act).astype(np.float32)
    x[4] *= 100.0                                                 # one loud row must not coarsen the others
    batch = np.asarray(matmul(jnp.asarray(x), leaves, jnp.float32))
    for i in range(6):
        alone = np.asarray(matmul(jnp.asarray(x[i:i + 1]), leaves, jnp.float32))
        np.testing.assert_array_equal(alone[0], batch[i])


def test_the_form_survives_storage_and_refuses_a_mismatched_smoothing():
    rng = np.random.default_rng(4)
    ws, act = _weights_and_ranges(rng)
    t = quantize_w8a8(ws[0], smoothing(ws, act))
    back = unflatten(flatten({"model.layers.0.self_attn.q_proj.weight": t}))["model.layers.0.self_attn.q_proj.weight"]
    assert back.mode == "w8a8" and np.array_equal(back.act_smooth, t.act_smooth)
    assert np.array_equal(back.qweight, t.qweight) and np.array_equal(back.scale, t.scale)
    with pytest.raises(ValueError, match="share their input's smoothing"):
        fuse_quantized([t, quantize_w8a8(ws[1], smoothing(ws[1:], act))])
    with pytest.raises(ValueError, match="act_smooth"):
        QuantizedTensor("int8", t.qweight, t.scale, act_smooth=t.act_smooth[:10])


def test_w8a8_calibrates_even_when_asked_not_to(tiny_llama_dir):
    """`calibrated` is fp8's switch; w8a8's smoothing cannot exist without the ranges."""
    from jaxserve.checkpoints import load_checkpoint
    from jaxserve.models import ModelConfig
    from jaxserve.quant.prepare import QuantRequest, prepare

    ckpt = load_checkpoint(tiny_llama_dir)
    config = ModelConfig.from_hf_config(ckpt.config)
    a = prepare(ckpt, QuantRequest("w8a8", calibrated=False), config, jnp.float32).checkpoint
    b = prepare(ckpt, QuantRequest("w8a8"), config, jnp.float32).checkpoint
    assert a.identity == b.identity
    assert all(t.mode == "w8a8" for t in a.tensors.values() if isinstance(t, QuantizedTensor))
