"""The model's contract with the runner and the loaders, checked without torch."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import (LlamaModel, ModelConfig, RopeScaling, abstract_params,
                             compute_logits, dense_causal_attention, forward, init_random_params,
                             params_from_hf)
from jaxserve.models.rope import inverse_frequencies


FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _config(model_type="llama", **overrides) -> ModelConfig:
    fields = dict(model_type=model_type, vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return ModelConfig(**fields)


CONFIGS = {
    "llama_untied": _config(),
    "llama_tied": _config(tie_word_embeddings=True),
    "llama_attention_bias": _config(attention_bias=True),
    "mistral_window": _config("mistral", sliding_window=4),
    "qwen2_bias": _config("qwen2", attention_bias=True, tie_word_embeddings=True),
    "qwen3_qk_norm": _config("qwen3", qk_norm=True, head_dim=16),
}


def _hf_tensors(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under HF names and HF shapes (Linear weights [out, in])."""
    rng = np.random.default_rng(seed)
    c = config
    d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
    n, k = c.num_attention_heads, c.num_key_value_heads
    shapes = {"model.embed_tokens.weight": (c.vocab_size, d), "model.norm.weight": (d,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (n * h, d),
                       p + "self_attn.k_proj.weight": (k * h, d),
                       p + "self_attn.v_proj.weight": (k * h, d),
                       p + "self_attn.o_proj.weight": (d, n * h),
                       p + "mlp.gate_proj.weight": (f, d),
                       p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
        if c.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (n * h,),
                           p + "self_attn.k_proj.bias": (k * h,),
                           p + "self_attn.v_proj.bias": (k * h,)})
            if c.model_type != "qwen2":
                shapes[p + "self_attn.o_proj.bias"] = (d,)
        if c.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (h,), p + "self_attn.k_norm.weight": (h,)})
    return {name: rng.normal(0, 0.2, shape).astype(np.float32) for name, shape in shapes.items()}


def _jit_forward(config, attention):
    # eager op-by-op dispatch of even a tiny model costs seconds on a shared 2-core machine;
    # optimization level 0 halves the compile time, which dominates at these sizes
    return jax.jit(lambda params, ids, positions, caches=None:
                   forward(params, config, ids, positions, caches, attention),
                   compiler_options=FAST_COMPILE)


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_documented_layout_is_what_the_flax_module_creates(name):
    config = CONFIGS[name]
    ids = jnp.zeros((5,), jnp.int32)
    created = jax.eval_shape(
        lambda: LlamaModel(config, jnp.bfloat16).init(
            jax.random.key(0), ids, ids, [None] * config.num_hidden_layers,
            dense_causal_attention(config))["params"])
    expected = {k: v for k, v in abstract_params(config, jnp.bfloat16).items() if k != "lm_head"}
    assert _shapes(created) == _shapes(expected)
    assert ("lm_head" in abstract_params(config, jnp.float32)) == (not config.tie_word_embeddings)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_params_from_hf_follow_the_documented_layout(name):
    config = CONFIGS[name]
    params = params_from_hf(config, _hf_tensors(config), jnp.bfloat16)
    assert _shapes(params) == _shapes(abstract_params(config, jnp.bfloat16))


def test_per_layer_weights_are_separate_arrays_not_a_stacked_tensor():
    params = abstract_params(CONFIGS["llama_untied"], jnp.float32)
    assert {"layers_0", "layers_1"} <= set(params)
    assert all(len(leaf.shape) <= 2 for leaf in jax.tree.leaves(params))


def test_fused_projections_keep_hf_column_order():
    config = CONFIGS["qwen2_bias"]
    tensors = _hf_tensors(config)
    layer = params_from_hf(config, tensors, jnp.float32)["layers_1"]
    a, m = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = np.asarray(layer["self_attn"]["qkv_proj"]["kernel"])
    want = np.concatenate([tensors[a + p + "_proj.weight"].T for p in "qkv"], axis=1)
    np.testing.assert_array_equal(qkv, want)
    bias = np.asarray(layer["self_attn"]["qkv_proj"]["bias"])
    np.testing.assert_array_equal(bias, np.concatenate([tensors[a + p + "_proj.bias"] for p in "qkv"]))
    gate_up = np.asarray(layer["mlp"]["gate_up_proj"]["kernel"])
    np.testing.assert_array_equal(
        gate_up, np.concatenate([tensors[m + "gate_proj.weight"].T, tensors[m + "up_proj.weight"].T], 1))


def test_missing_tensor_is_named():
    config = CONFIGS["qwen3_qk_norm"]
    tensors = _hf_tensors(config)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        params_from_hf(config, tensors, jnp.float32)


def test_missing_lm_head_of_an_untied_model_is_named():
    config = CONFIGS["llama_untied"]
    tensors = _hf_tensors(config)
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'lm_head\.weight'"):
        params_from_hf(config, tensors, jnp.float32)


def test_wrong_shape_is_named_with_both_shapes():
    config = CONFIGS["llama_untied"]
    tensors = _hf_tensors(config)
    # a transposed (GGUF-like [in, out]) projection must not slip through
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].T
    name = r"'model\.layers\.0\.mlp\.up_proj\.weight'"
    with pytest.raises(ValueError, match=name + r" has shape \(32, 48\).*\(48, 32\)"):
        params_from_hf(config, tensors, jnp.float32)


def test_tensor_the_config_does_not_describe_is_rejected():
    config = CONFIGS["llama_untied"]   # attention_bias=False, but the checkpoint has biases
    tensors = _hf_tensors(CONFIGS["llama_attention_bias"])
    with pytest.raises(ValueError, match=r"does not use: 'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        params_from_hf(config, tensors, jnp.float32)


def test_tied_checkpoint_may_store_the_lm_head_twice():
    config = CONFIGS["llama_tied"]
    tensors = _hf_tensors(config)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    params = params_from_hf(config, tensors, jnp.float32)
    assert "lm_head" not in params


def _segment_attention(config, segment_ids):
    """Dense causal attention within each packed segment: a stand-in for the paged attention."""
    dense = dense_causal_attention(config)

    def attention(layer_idx, q, k, v, cache):
        outs = [dense(layer_idx, q[s], k[s], v[s], None)[0] for s in segment_ids]
        return jnp.concatenate(outs, axis=0), cache

    return attention


@pytest.mark.parametrize("name", ["mistral_window"])
def test_packed_ragged_batch_equals_each_sequence_alone(name):
    # The model sees only tokens and positions; two sequences packed back to back, each with its
    # own positions from 0, must give exactly what each gives alone.
    config = CONFIGS[name]
    params = params_from_hf(config, _hf_tensors(config, seed=3), jnp.float32)
    a = jnp.array([5, 17, 3, 88, 42, 9, 60], jnp.int32)
    b = jnp.array([11, 2, 71, 30, 6], jnp.int32)
    packed_ids = jnp.concatenate([a, b])
    positions = jnp.concatenate([jnp.arange(7), jnp.arange(5)]).astype(jnp.int32)
    attention = _segment_attention(config, [slice(0, 7), slice(7, 12)])
    packed, _ = _jit_forward(config, attention)(params, packed_ids, positions)
    dense = _jit_forward(config, dense_causal_attention(config))
    alone = [dense(params, ids, jnp.arange(len(ids), dtype=jnp.int32))[0] for ids in (a, b)]
    np.testing.assert_allclose(np.asarray(packed), np.concatenate(alone), rtol=1e-5, atol=1e-5)


def test_positions_reach_the_model_through_rope():
    config = CONFIGS["llama_untied"]
    params = params_from_hf(config, _hf_tensors(config), jnp.float32)
    ids = jnp.array([4, 8, 15, 16, 23], jnp.int32)
    run = _jit_forward(config, dense_causal_attention(config))
    at_zero, _ = run(params, ids, jnp.arange(5, dtype=jnp.int32))
    shifted, _ = run(params, ids, jnp.arange(5, dtype=jnp.int32) + 40)
    # RoPE is relative: a shift changes the result only by rounding
    np.testing.assert_allclose(np.asarray(at_zero), np.asarray(shifted), rtol=1e-4, atol=1e-4)
    scrambled, _ = run(params, ids, jnp.array([0, 9, 2, 30, 1], jnp.int32))
    assert np.abs(np.asarray(scrambled) - np.asarray(at_zero)).max() > 1e-2


def test_caches_pass_through_the_attention_function_layer_by_layer():
    config = CONFIGS["qwen2_bias"]
    params = init_random_params(config, jax.random.key(1), jnp.float32, scale=0.2)
    dense = dense_causal_attention(config)
    seen = []

    def attention(layer_idx, q, k, v, cache):
        seen.append((layer_idx, q.shape, k.shape, v.shape))
        k_cache, v_cache = cache
        return dense(layer_idx, q, k, v, None)[0], (k_cache + 1, v_cache + 2)

    caches = [(jnp.zeros(3) + i, jnp.zeros(3) - i) for i in range(config.num_hidden_layers)]
    hidden, new = _jit_forward(config, attention)(
        params, jnp.array([1, 2, 3], jnp.int32), jnp.arange(3, dtype=jnp.int32), caches)
    assert hidden.shape == (3, config.hidden_size)
    assert seen == [(i, (3, 4, 8), (3, 2, 8), (3, 2, 8)) for i in range(2)]
    for i, (k_cache, v_cache) in enumerate(new):
        np.testing.assert_array_equal(np.asarray(k_cache), i + 1)
        np.testing.assert_array_equal(np.asarray(v_cache), -i + 2)


def test_wrong_number_of_caches_is_rejected():
    config = CONFIGS["llama_untied"]
    params = init_random_params(config, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="len\\(kv_caches\\)=1"):
        forward(params, config, jnp.array([1], jnp.int32), jnp.array([0], jnp.int32), [None],
                dense_causal_attention(config))


def test_jitted_step_with_donated_caches_and_random_params():
    # the runner's use: random weights (no checkpoint), bf16, caches donated to a jitted step
    config = CONFIGS["mistral_window"]
    params = init_random_params(config, jax.random.key(2), jnp.bfloat16, scale=0.2)
    assert _shapes(params) == _shapes(abstract_params(config, jnp.bfloat16))
    assert np.all(np.asarray(params["layers_1"]["post_attention_layernorm"]["weight"]) == 1)
    dense = dense_causal_attention(config)

    def attention(layer_idx, q, k, v, cache):
        return dense(layer_idx, q, k, v, None)[0], cache.at[: k.shape[0]].set(k)

    def step(params, ids, positions, caches):
        hidden, caches = forward(params, config, ids, positions, caches, attention)
        return compute_logits(params, config, hidden[-1:]), caches

    step = jax.jit(step, donate_argnums=3, compiler_options=FAST_COMPILE)
    caches = [jnp.zeros((8, 2, 8), jnp.bfloat16) for _ in range(2)]
    logits, caches = step(params, jnp.arange(6, dtype=jnp.int32), jnp.arange(6, dtype=jnp.int32),
                          caches)
    assert logits.shape == (1, config.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()
    assert np.abs(np.asarray(caches[0][:6], np.float32)).sum() > 0
    assert np.all(np.asarray(caches[0][6:], np.float32) == 0)


def test_llama3_rope_scaling_covers_all_three_bands_in_the_parity_config():
    # the parity test's Llama-3 model (head_dim 16, original context 64): every branch of the
    # scaling must be exercised there, or a bug in one branch could pass unnoticed
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64)
    plain = inverse_frequencies(_config(head_dim=16, num_attention_heads=2))
    scaled = inverse_frequencies(_config(head_dim=16, num_attention_heads=2, rope_scaling=scaling))
    ratio = plain / scaled
    assert np.any(np.isclose(ratio, 1.0))                            # short wavelengths kept
    assert np.any(np.isclose(ratio, 8.0))                            # long ones slowed by factor
    assert np.any((ratio > 1.01) & (ratio < 7.99))                   # smooth band between
    wavelen = 2 * math.pi / plain
    assert np.all(np.isclose(ratio, 1.0) == (wavelen < 16))
