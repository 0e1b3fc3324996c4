"""GGUF Q8_0 / Q4_0 / Q4_1 weights loaded natively as int8 / int4 QuantizedTensors.

The float load dequantizes each block with the gguf package; the native load keeps the blocks.
They must stand for the same values (the scales only widen float16 -> float32), and the model
run on either must agree to float32 rounding. The native load has its own identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ckpt_testkit import tiny_config, tiny_tensors, write_gguf
from gguf import GGMLQuantizationType as Q

from jaxserve.checkpoints import load_checkpoint
from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.models import ModelConfig, compute_logits, dense_causal_attention, forward, params_from_hf
from jaxserve.quant.dequantize import dequantize


def _types(name: str):
    if ".mlp.down_proj." in name:
        return Q.Q8_0
    if ".mlp." in name:
        return Q.Q4_1
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return Q.Q4_0
    return Q.F32


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    config = tiny_config("llama", tied=False)
    path = tmp_path_factory.mktemp("native") / "m.gguf"
    return write_gguf(path, "llama", config, tiny_tensors(config), types=_types)


@pytest.mark.parametrize("want, native_names", [
    ("int4", ("self_attn.", "mlp.gate_proj", "mlp.up_proj")),
    ("int8", ("mlp.down_proj",)),
])
def test_native_blocks_stand_for_the_dequantized_values(gguf_file, want, native_names):
    ref = load_checkpoint(gguf_file)
    got = load_checkpoint(gguf_file, native_quantization=want)
    assert got.identity != ref.identity
    quantized = {n for n, t in got.tensors.items() if isinstance(t, QuantizedTensor)}
    assert quantized and all(any(k in n for k in native_names) for n in quantized)
    # q and k rows are un-permuted (llama.cpp's RoPE order) in every part of the tensor
    assert any(".self_attn.k_proj." in n for n in quantized) == (want == "int4")
    for name in quantized:
        t = got.tensors[name]
        assert t.kind == want and t.group == 32 and t.shape == ref.tensors[name].shape
        assert (t.offset is not None) == (".mlp.gate_proj." in name or ".mlp.up_proj." in name)
        np.testing.assert_allclose(dequantize(t), ref.tensors[name], rtol=1e-6, atol=1e-7)


def test_model_on_native_blocks_equals_the_float_load(gguf_file):
    ref = load_checkpoint(gguf_file)
    got = load_checkpoint(gguf_file, native_quantization="int4")
    config = ModelConfig.from_hf_config(ref.config)
    ids = jnp.array([5, 9, 2, 33, 7, 1], jnp.int32)

    def logits(tensors):
        params = params_from_hf(config, tensors, jnp.float32)
        hidden, _ = jax.jit(lambda p: forward(p, config, ids, jnp.arange(6, dtype=jnp.int32), None,
                                              dense_causal_attention(config)))(params)
        return np.asarray(compute_logits(params, config, hidden))

    want = logits(ref.tensors)
    # down_proj (Q8_0) stays float here, so one params tree mixes quantized and float projections
    np.testing.assert_allclose(logits(got.tensors), want, atol=1e-4 * np.abs(want).max(), rtol=0)
    params = params_from_hf(config, got.tensors, jnp.float32)
    assert params["layers_0"]["mlp"]["gate_up_proj"]["offset"].shape == (config.hidden_size // 32,
                                                                         2 * config.intermediate_size)
