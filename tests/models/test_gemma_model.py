"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random models, without the engine.

The models (testing/tiny_models.py) have a sliding window of 8 and run 56-token sequences, so
most positions of a sliding layer see a window, not the whole prefix; their norms hold random
weights (HF initializes Gemma's (1 + w) norms to zeros, which would hide a wrong norm). Gemma 2
alternates sliding and global layers and soft-caps attention scores (50) and final logits (30);
Gemma 3 has q/k norms, sliding layers on a local RoPE base (1e4) and a global layer on another
(1e6, linear scaling x8).

Tolerances as tests/models/test_hf_parity.py's (logits have std about 1.6 here): fp32 within 1e-4
of HF's fp32 logits; bf16 no more than 2x as far from HF's fp32 logits as HF's own bf16 model is;
greedy decoding token-identical to HF's `generate`, every step's top-1/top-2 gap at least 100x
the fp32 tolerance so a match is not luck. Each feature check removes the feature and requires a
miss of the same 100x, so a feature that did nothing could not pass.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import gemma
from jaxserve.models.attention import dense_causal_attention
from jaxserve.models.config import LayerAttention, ModelConfig
from jaxserve.models.params import params_from_hf

FP32_ATOL = 1e-4
BF16_ERROR_RATIO = 2.0
MIN_GAP = 1e-2                     # 100x FP32_ATOL: greedy gaps, and how far a removed feature must move
PROMPT_LEN = 24
NEW_TOKENS = 32
WINDOW = 8
FAST_COMPILE = {"xla_backend_optimization_level": 0}

ARCHS = {"gemma2": dict(num_layers=2, seed=0), "gemma3": dict(num_layers=3, seed=0)}


@dataclasses.dataclass
class Reference:
    arch: str
    config: ModelConfig
    tensors: dict
    tokens: np.ndarray             # [PROMPT_LEN + NEW_TOKENS] prompt + HF greedy continuation
    logits_fp32: np.ndarray        # [SEQ, V] HF fp32 over `tokens`
    logits_bf16: np.ndarray        # [SEQ, V] HF bf16 over `tokens`, as float32


@pytest.fixture(scope="module", params=sorted(ARCHS))
def ref(request, tmp_path_factory) -> Reference:
    import torch
    import transformers
    from safetensors.numpy import load_file

    from jaxserve.testing.tiny_models import hf_greedy, make_tiny_model

    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch, sliding_window=WINDOW, **ARCHS[arch])
    with open(os.path.join(path, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    prompt = np.random.default_rng(1).integers(3, config.vocab_size, PROMPT_LEN).tolist()
    tokens = np.asarray(prompt + hf_greedy(path, prompt, NEW_TOKENS), np.int32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits_fp32 = model(torch.tensor(tokens[None].astype(np.int64))).logits[0].numpy()
        logits_bf16 = model.to(torch.bfloat16)(torch.tensor(tokens[None].astype(np.int64))).logits[0].float().numpy()
    return Reference(arch, config, load_file(os.path.join(path, "model.safetensors")), tokens,
                     logits_fp32, logits_bf16)


@functools.lru_cache(maxsize=None)
def _logits_fn(config: ModelConfig, attention_config: ModelConfig | None = None):
    """[T] -> [T, V]; the attention's windows, scales and caps are `attention_config`'s (default:
    the model's), so a test can change them without changing the model's RoPE."""
    attention = dense_causal_attention(attention_config or config)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def logits(params, token_ids):
        positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
        hidden, _ = gemma.forward(params, config, token_ids, positions, None, attention)
        return gemma.compute_logits(params, config, hidden)

    return logits


def _logits(config: ModelConfig, params, tokens, attention_config=None) -> np.ndarray:
    return np.asarray(_logits_fn(config, attention_config)(params, jnp.asarray(tokens, jnp.int32)))


def _params(ref: Reference, dtype=jnp.float32):
    return params_from_hf(ref.config, ref.tensors, dtype)       # through the registry's declared tensors


# --- parity ----------------------------------------------------------------------------------

def test_fp32_logits_match_hf(ref):
    logits = _logits(ref.config, _params(ref), ref.tokens)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref.logits_fp32, rtol=0, atol=FP32_ATOL)


def test_greedy_generation_matches_hf_generate(ref):
    steps = ref.logits_fp32[PROMPT_LEN - 1:-1]                                 # [NEW, V]
    top2 = np.sort(steps, axis=-1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > MIN_GAP, "near-tie: pick another seed"
    # free-running greedy decode, the whole zero-padded sequence recomputed each step (causal
    # attention keeps the padding after position t from affecting position t)
    params = _params(ref)
    tokens = np.zeros(len(ref.tokens), np.int32)
    tokens[:PROMPT_LEN] = ref.tokens[:PROMPT_LEN]
    for t in range(PROMPT_LEN, len(tokens)):
        tokens[t] = int(np.argmax(_logits(ref.config, params, tokens)[t - 1]))
    assert tokens.tolist() == ref.tokens.tolist()


def test_bf16_logits_as_accurate_as_hf_bf16(ref):
    params = _params(ref, jnp.bfloat16)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    logits = _logits(ref.config, params, ref.tokens)
    ours = np.abs(logits - ref.logits_fp32).max()
    hf = np.abs(ref.logits_bf16 - ref.logits_fp32).max()
    assert ours <= BF16_ERROR_RATIO * hf, (ours, hf)


def test_shard_major_layout_gives_the_same_logits(ref):
    # tensor parallelism's fused-column layout (parallel/layout.py), run on one device: only the
    # split of each fused projection's output changes
    from jaxserve.parallel.layout import HeadLayout, split_columns_order

    shards, f = 2, ref.config.intermediate_size
    heads = HeadLayout.for_model(ref.config, shards)
    params = _params(ref)
    permuted = jax.tree.map(lambda x: x, params)
    for i in range(ref.config.num_hidden_layers):
        layer = permuted[f"layers_{i}"]
        layer["self_attn"]["qkv_proj"]["kernel"] = layer["self_attn"]["qkv_proj"]["kernel"][:, heads.qkv_columns()]
        layer["mlp"]["gate_up_proj"]["kernel"] = layer["mlp"]["gate_up_proj"]["kernel"][
            :, split_columns_order((f, f), shards)]
    attention = dense_causal_attention(ref.config)
    ids = jnp.asarray(ref.tokens, jnp.int32)
    positions = jnp.arange(len(ref.tokens), dtype=jnp.int32)
    run = jax.jit(lambda p: gemma.compute_logits(p, ref.config, gemma.forward(
        p, ref.config, ids, positions, None, attention, shards=shards)[0]), compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(np.asarray(run(permuted)), ref.logits_fp32, rtol=0, atol=FP32_ATOL)


def test_documented_layout_is_what_the_flax_module_creates(ref):
    config = ref.config
    ids = jnp.zeros((5,), jnp.int32)
    created = jax.eval_shape(lambda: gemma.GemmaModel(config, jnp.float32).init(
        jax.random.key(0), ids, ids, [None] * config.num_hidden_layers, dense_causal_attention(config))["params"])
    converted = jax.eval_shape(lambda: _params(ref))
    shapes = functools.partial(jax.tree.map, lambda x: (tuple(x.shape), jnp.dtype(x.dtype)))
    assert shapes(created) == shapes(converted)
    layer = converted["layers_0"]
    assert {"pre_feedforward_layernorm", "post_feedforward_layernorm"} <= set(layer)
    assert ("q_norm" in layer["self_attn"]) == (ref.arch == "gemma3")
    assert "lm_head" not in converted


# --- each Gemma feature is there and matters -------------------------------------------------

def _without(ref: Reference, attention: dict | None = None, **changes) -> np.ndarray:
    """The fp32 logits, same weights, with config fields changed (`attention`: for the
    attention function only)."""
    config = dataclasses.replace(ref.config, **changes)
    attention_config = dataclasses.replace(config, **attention) if attention else None
    return _logits(config, _params(ref), ref.tokens, attention_config)


def test_sliding_layers_see_a_window_and_global_layers_all_keys(ref):
    config = ref.config
    types = config.layer_types
    assert "sliding_attention" in types and "full_attention" in types
    scale = config.head_dim ** -0.5          # query_pre_attn_scalar = head_dim in the tiny models
    cap = 50.0 if ref.arch == "gemma2" else None
    for i, kind in enumerate(types):
        window = WINDOW if kind == "sliding_attention" else None
        assert config.layer_attention(i) == LayerAttention(sm_scale=scale, sliding_window=window, soft_cap=cap)
    # every layer's attention global (RoPE as it was): the same up to the window (no key is out
    # of reach yet), a miss after it
    n = config.num_hidden_layers
    everywhere = _without(ref, attention=dict(layer_types=("full_attention",) * n))
    np.testing.assert_allclose(everywhere[:WINDOW], ref.logits_fp32[:WINDOW], rtol=0, atol=FP32_ATOL)
    assert np.abs(everywhere[WINDOW:] - ref.logits_fp32[WINDOW:]).max() > MIN_GAP
    # every layer's attention sliding: the global layers' long reach matters too
    windowed = _without(ref, attention=dict(layer_types=("sliding_attention",) * n))
    np.testing.assert_allclose(windowed[:WINDOW], ref.logits_fp32[:WINDOW], rtol=0, atol=FP32_ATOL)
    assert np.abs(windowed[WINDOW:] - ref.logits_fp32[WINDOW:]).max() > MIN_GAP


def test_gemma2_final_soft_cap_bounds_the_logits():
    config = ModelConfig.from_hf_config(_GEMMA2_HF)                          # HF's default caps
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    hidden = jnp.stack([jnp.full(config.hidden_size, 100.0), jnp.full(config.hidden_size, -1.0)])
    params = {"embed_tokens": {"embedding": jnp.ones((config.vocab_size, config.hidden_size))}}
    logits = np.asarray(gemma.compute_logits(params, config, hidden))        # uncapped: 6400, -64
    np.testing.assert_allclose(logits[0], 30.0 * np.tanh(6400 / 30), rtol=1e-6)
    np.testing.assert_allclose(logits[1], 30.0 * np.tanh(-64 / 30), rtol=1e-6)


def test_gemma2_soft_caps_change_the_logits(ref):
    if ref.arch != "gemma2":
        pytest.skip("Gemma 3 has no soft caps")
    no_attn_cap = _without(ref, attn_logit_softcap=None)
    assert np.abs(no_attn_cap - ref.logits_fp32).max() > MIN_GAP
    no_final_cap = _without(ref, final_logit_softcap=None)
    assert np.abs(no_final_cap - ref.logits_fp32).max() > MIN_GAP
    np.testing.assert_allclose(30.0 * np.tanh(no_final_cap / 30.0), ref.logits_fp32, rtol=0, atol=FP32_ATOL)


def test_gemma3_local_and_global_rope_bases_both_matter(ref):
    if ref.arch != "gemma3":
        pytest.skip("Gemma 2 has one RoPE base")
    config = ref.config
    assert (config.rope_theta, config.rope_local_theta, config.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert gemma.layer_rope(config, 0) == (1e4, None)
    assert gemma.layer_rope(config, config.num_hidden_layers - 1) == (1e6, 8.0)
    for changes in (dict(rope_local_theta=None), dict(rope_linear_factor=None), dict(rope_theta=1e4)):
        assert np.abs(_without(ref, **changes) - ref.logits_fp32).max() > MIN_GAP, changes


def test_dense_attention_is_the_paged_reference_with_each_layers_window_scale_and_cap():
    # one sequence in pages: the dense attention the parity tests use and the kernels' reference
    # (tests/pallas_kernels/) agree layer by layer, with a scale large enough for the cap to bend
    from pallas_kernels import ragged_paged_attention_reference

    config = ModelConfig.from_hf_config(dict(_GEMMA2_HF, sliding_window=WINDOW, query_pre_attn_scalar=1.0,
                                             attn_logit_softcapping=5.0))
    t, n, k, h, block = 20, config.num_attention_heads, config.num_key_value_heads, config.head_dim, 4
    rng = np.random.default_rng(0)
    q, key, value = (jnp.asarray(rng.standard_normal((t, heads, h)), jnp.float32) for heads in (n, k, k))
    pages = rng.permutation(np.arange(1, 8))[: t // block]                   # non-contiguous
    k_cache = jnp.zeros((8, block, k, h)).at[pages].set(key.reshape(-1, block, k, h))
    v_cache = jnp.zeros((8, block, k, h)).at[pages].set(value.reshape(-1, block, k, h))
    dense = dense_causal_attention(config)
    outs = []
    for layer in range(config.num_hidden_layers):
        spec = config.layer_attention(layer)
        want = ragged_paged_attention_reference(
            q, k_cache, v_cache, jnp.array([t], jnp.int32), jnp.asarray(pages[None], jnp.int32),
            jnp.array([0, t], jnp.int32), jnp.array([1], jnp.int32), sm_scale=spec.sm_scale,
            sliding_window=spec.sliding_window, soft_cap=spec.soft_cap)
        got, _ = dense(layer, q, key, value, None)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        uncapped = ragged_paged_attention_reference(
            q, k_cache, v_cache, jnp.array([t], jnp.int32), jnp.asarray(pages[None], jnp.int32),
            jnp.array([0, t], jnp.int32), jnp.array([1], jnp.int32), sm_scale=spec.sm_scale,
            sliding_window=spec.sliding_window)
        assert np.abs(np.asarray(uncapped) - np.asarray(want)).max() > 0.05
        outs.append(np.asarray(got))
    assert np.abs(outs[0] - outs[1]).max() > 0.05          # a sliding layer and a global one


# --- config parsing --------------------------------------------------------------------------

_GEMMA2_HF = dict(model_type="gemma2", vocab_size=320, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_gemma2_config_defaults_are_hf_defaults():
    # an older config.json: no layer_types, no rope_parameters, caps and scalar left to defaults
    config = ModelConfig.from_hf_config(dict(_GEMMA2_HF, rope_theta=10000.0, sliding_window=4096))
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.query_pre_attn_scalar == 256 and config.layer_attention(0).sm_scale == 256 ** -0.5
    assert config.tie_word_embeddings and not config.qk_norm
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert config.rope_local_theta is None and config.rope_linear_factor is None
    assert [config.layer_attention(i).sliding_window for i in range(4)] == [4096, None, 4096, None]


def test_gemma3_older_config_form_is_read():
    cfg = dict(_GEMMA2_HF, model_type="gemma3_text", num_hidden_layers=7, sliding_window=512,
               rope_theta=1_000_000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_logit_softcapping=50.0)
    config = ModelConfig.from_hf_config(cfg)
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (config.rope_theta, config.rope_local_theta, config.rope_linear_factor) == (1e6, 1e4, 8.0)
    assert config.qk_norm and config.final_logit_softcap is None
    # HF's Gemma 3 attention never passes attn_logit_softcapping on
    assert config.attn_logit_softcap is None and config.layer_attention(0).soft_cap is None


@pytest.mark.parametrize("cfg, match", [
    (dict(_GEMMA2_HF, model_type="gemma3_text", rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "'yarn'.*only 'linear'"),
    (dict(_GEMMA2_HF, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "'dynamic'.*only 'linear'"),
    (dict(_GEMMA2_HF, model_type="gemma3_text", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}), "sliding layers"),
    (dict(_GEMMA2_HF, model_type="gemma3_text", use_bidirectional_attention=True), "bidirectional"),
    (dict(model_type="gemma3", text_config={}), "gemma3_text"),
    (dict(_GEMMA2_HF, hidden_activation="relu"), "hidden_activation='relu'"),
])
def test_unsupported_gemma_configs_are_refused_by_name(cfg, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(cfg)


def test_llama_layer_attention_is_head_dim_scale_and_its_window_everywhere():
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  rope_theta=1e4, max_position_embeddings=128, tie_word_embeddings=False)
    for model_type, window in (("llama", None), ("mistral", 4)):
        config = ModelConfig(model_type=model_type, sliding_window=window, **fields)
        assert [config.layer_attention(i) for i in range(3)] == [LayerAttention(8 ** -0.5, window, None)] * 3
        with pytest.raises(ValueError, match="layer 3"):
            config.layer_attention(3)
