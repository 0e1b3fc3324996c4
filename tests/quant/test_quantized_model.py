"""A quantized checkpoint through params_from_hf and the model, against the float model whose
weights are the quantized ones' dequantized values; and the identities of quantized checkpoints.

int8 / int4 compute exactly x @ dequantize(W) up to float32 rounding, so the whole model must
agree with the dequantized float model to float32 rounding amplified through two layers
(checked at 1e-4 of the logits' scale). A fused projection in the wrong column order, a
transposed scale or a misplaced group would be off by O(1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints import Checkpoint
from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.models import ModelConfig, compute_logits, dense_causal_attention, forward, params_from_hf
from jaxserve.quant.checkpoint import quantize_checkpoint
from jaxserve.quant.dequantize import dequantize
from jaxserve.quant.spec import QuantSpec

from tests.models.test_llama_model import CONFIGS, _hf_tensors


def _hf_config(config: ModelConfig) -> dict:
    """The HF config.json dict a ModelConfig reads back as itself (quantization finds the
    projections it may replace through the config's architecture)."""
    fields = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "tie_word_embeddings", "attention_bias")
    hf = {name: getattr(config, name) for name in fields}
    assert ModelConfig.from_hf_config(hf) == config
    return hf


def _ckpt(tensors, config: ModelConfig) -> Checkpoint:
    return Checkpoint(config=_hf_config(config), tensors=tensors, tokenizer=None, identity="sha256:" + "0" * 64,
                      source="t", format="hf")


def _logits(config: ModelConfig, params) -> np.ndarray:
    ids = jnp.array([3, 14, 15, 9, 2, 6, 5, 35, 8, 9], jnp.int32)

    @jax.jit
    def run(params):
        hidden, _ = forward(params, config, ids, jnp.arange(10, dtype=jnp.int32), None,
                            dense_causal_attention(config))
        return compute_logits(params, config, hidden)

    return np.asarray(run(params))


@pytest.mark.parametrize("name", ["llama_untied", "qwen2_bias", "qwen3_qk_norm", "llama_attention_bias"])
@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32), QuantSpec("int4", 32, symmetric=True)],
                         ids=["int8", "int4", "int4_symmetric"])
def test_quantized_model_equals_its_dequantized_float_model(name, spec):
    config = CONFIGS[name]
    tensors = _hf_tensors(config)
    q = quantize_checkpoint(_ckpt(tensors, config), spec)
    deq = {k: dequantize(v) if isinstance(v, QuantizedTensor) else v for k, v in q.tensors.items()}
    got = _logits(config, params_from_hf(config, q.tensors, jnp.float32))
    want = _logits(config, params_from_hf(config, deq, jnp.float32))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    # and quantization changed something: the test compares two different weight sets
    assert np.abs(_logits(config, params_from_hf(config, tensors, jnp.float32)) - want).max() > 1e-4


def test_fp8_model_stays_near_the_float_model():
    config = CONFIGS["llama_untied"]
    tensors = _hf_tensors(config)
    # act_absmax of 8 for every input: a plausible calibration for these activations (norms ~1)
    acts = {f"layers_{i}/{m}": 8.0 for i in range(2)
            for m in ("self_attn/qkv_proj", "self_attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj")}
    q = quantize_checkpoint(_ckpt(tensors, config), QuantSpec("fp8"), act_absmax=acts, calibration_id="x")
    got = _logits(config, params_from_hf(config, q.tensors, jnp.float32))
    want = _logits(config, params_from_hf(config, tensors, jnp.float32))
    # e4m3 rounds weights and activations to 2^-4 relative: logits move by a few percent at most
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_quantized_params_hold_int_weights_and_float_embedding():
    config = CONFIGS["llama_untied"]
    q = quantize_checkpoint(_ckpt(_hf_tensors(config), config), QuantSpec("int4", 32))
    params = params_from_hf(config, q.tensors, jnp.float32)
    qkv = params["layers_0"]["self_attn"]["qkv_proj"]
    assert set(qkv) == {"qweight", "scale", "offset"} and qkv["qweight"].dtype == jnp.uint8
    assert qkv["qweight"].shape == (config.hidden_size // 2, (4 + 2 * 2) * config.head_dim)
    assert params["embed_tokens"]["embedding"].dtype == jnp.float32
    assert params["lm_head"]["kernel"].dtype == jnp.float32


def test_identity_covers_the_quantization():
    tensors = _hf_tensors(CONFIGS["llama_untied"])
    src = _ckpt(tensors, CONFIGS["llama_untied"])
    ids = {m: quantize_checkpoint(src, s).identity
           for m, s in {"int8": QuantSpec("int8"), "int4": QuantSpec("int4", 32),
                        "int4_128": QuantSpec("int4", 128), "int4_sym": QuantSpec("int4", 32, symmetric=True)}.items()}
    assert src.identity not in ids.values()
    assert len(set(ids.values())) == 4
    assert quantize_checkpoint(src, QuantSpec("int8")).identity == ids["int8"]       # stable
    other = dataclasses.replace(src, identity="sha256:" + "1" * 64)
    assert quantize_checkpoint(other, QuantSpec("int8")).identity != ids["int8"]
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(quantize_checkpoint(src, QuantSpec("int8")), QuantSpec("int4"))
