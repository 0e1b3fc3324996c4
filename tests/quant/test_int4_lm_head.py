"""int4 with quantize_lm_head: the LM head becomes an int4 weight in the projections' groups (tied
or not), also beside a GGUF's natively loaded Q4 blocks (no calibration needed); its logits are
the float matmul of the head's own dequantized values, and with the native CPU kernel they stay
within the activations' int8 rounding of those."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.checkpoints import load_checkpoint
from jaxserve.models import ModelConfig, registry
from jaxserve.models.linear import dequantize_weight
from jaxserve.models.params import params_from_hf
from jaxserve.quant.prepare import QuantRequest, prepare
from jaxserve.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_dir(request, tmp_path_factory):
    # hidden 64: two int4 groups of 32 per head row, which the native kernel computes
    return make_tiny_model(tmp_path_factory.mktemp("head4"), "llama", seed=5, hidden_size=64,
                           tie_word_embeddings=request.param)


def _params(ckpt, lm_head: bool):
    config = ModelConfig.from_hf_config(ckpt.config)
    prepared = prepare(ckpt, QuantRequest("int4", 32, lm_head=lm_head), config, jnp.float32)
    return config, prepared.checkpoint, params_from_hf(config, prepared.checkpoint.tensors, jnp.float32)


def test_the_head_is_int4_and_computes_its_own_dequantized_values(tiny_dir):
    ckpt = load_checkpoint(tiny_dir)
    config, plain_ckpt, plain = _params(ckpt, lm_head=False)
    _, head_ckpt, quantized = _params(ckpt, lm_head=True)
    head = quantized["lm_head"]
    assert head["qweight"].dtype == jnp.uint8
    assert head["qweight"].shape == (config.hidden_size // 2, config.vocab_size)
    assert head["scale"].shape == head["offset"].shape == (config.hidden_size // 32, config.vocab_size)
    np.testing.assert_array_equal(quantized["embed_tokens"]["embedding"], plain["embed_tokens"]["embedding"])
    assert head_ckpt.identity != plain_ckpt.identity

    model = registry.for_config(config).model()
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((5, config.hidden_size)), jnp.float32)
    got = np.asarray(model.compute_logits(quantized, config, hidden))
    want = np.asarray(hidden @ dequantize_weight(head, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    float_logits = np.asarray(model.compute_logits(plain, config, hidden))
    assert not np.array_equal(got, float_logits)             # the int4 head is what ran
    err = np.abs(got - float_logits).max(axis=1) / np.abs(float_logits).max(axis=1)
    assert err.max() < 0.2, err                              # 16 levels per group of 32 weights


def test_with_the_native_kernel_the_head_stays_within_the_activations_rounding(tiny_dir):
    from cpu_kernels import build
    from cpu_kernels.int8_dot import cpu_kernels

    if not build.registered():
        pytest.skip("no C++ compiler: the kernels cannot be built")
    ckpt = load_checkpoint(tiny_dir)
    config, _, quantized = _params(ckpt, lm_head=True)
    model = registry.for_config(config).model()
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((3, config.hidden_size)), jnp.float32)
    plain = jax.jit(lambda p, h: model.compute_logits(p, config, h)).lower(quantized, hidden)
    with cpu_kernels():
        native = jax.jit(lambda p, h: model.compute_logits(p, config, h)).lower(quantized, hidden)
    assert "jaxserve_int4_dot" in native.as_text() and "jaxserve_int4_dot" not in plain.as_text()
    want = np.asarray(plain.compile()(quantized, hidden))
    got = np.asarray(native.compile()(quantized, hidden))
    assert np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_a_ggufs_native_blocks_take_an_int4_head(tmp_path):
    from gguf import GGMLQuantizationType as Q

    from tests.checkpoints.ckpt_testkit import tiny_config, tiny_tensors, write_gguf

    config = tiny_config("llama", tied=True)
    tensors = tiny_tensors(config, seed=2)
    path = write_gguf(tmp_path / "m.gguf", "llama", config, tensors,
                      types=lambda name: Q.Q4_1 if name.endswith("proj.weight") else Q.F32)
    native = load_checkpoint(path, native_quantization="int4")
    _, plain_ckpt, plain = _params(native, lm_head=False)
    _, head_ckpt, quantized = _params(native, lm_head=True)
    assert "lm_head" not in plain and quantized["lm_head"]["qweight"].dtype == jnp.uint8
    assert head_ckpt.identity != plain_ckpt.identity
    # the projections are the file's own blocks, untouched
    for name, t in plain_ckpt.tensors.items():
        if name.endswith("proj.weight"):
            np.testing.assert_array_equal(head_ckpt.tensors[name].qweight, t.qweight)
