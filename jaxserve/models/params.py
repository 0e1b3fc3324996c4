"""The params pytree: its layout, conversion from HF tensors, and random init.

Layout (every leaf a jnp array in the model dtype; kernels are [in, out], used as `x @ W`):

    embed_tokens/embedding               [V, D]   (also the LM head when tied)
    layers_{i}/input_layernorm/weight    [D]
    layers_{i}/self_attn/qkv_proj/kernel [D, (N + 2K) * H]   columns: q | k | v
    layers_{i}/self_attn/qkv_proj/bias   [(N + 2K) * H]      (attention_bias)
    layers_{i}/self_attn/q_norm/weight   [H]                 (qk_norm; k_norm likewise)
    layers_{i}/self_attn/o_proj/kernel   [N * H, D]          (+ bias: Llama/Qwen3 attention_bias)
    layers_{i}/post_attention_layernorm/weight [D]
    layers_{i}/mlp/gate_up_proj/kernel   [D, 2F]             columns: gate | up
    layers_{i}/mlp/down_proj/kernel      [F, D]
    norm/weight                          [D]
    lm_head/kernel                       [D, V]   (untied only)

A quantized checkpoint (checkpoints/quantized.py) gives its projections (qkv, o, gate_up, down)
`qweight` / `scale` (/ `offset`, `act_scale`, `act_smooth`) leaves in place of `kernel`, in the same
[in, out] orientation but for w8a8's qweight, [out, in] (models/quantized_linear.py); embedding,
norms and lm_head are always float.

Per-layer subtrees, never stacked [L, ...] arrays, and fused q/k/v and gate/up projections:
the forms XLA:CPU runs fastest (docs/facts.md). `abstract_params` is the single description of this
layout; conversion, random init and the tests all follow it.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoints.quantized import QuantizedTensor
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import Params, has_o_proj_bias

# HF tensors that carry no weights jaxserve needs
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def abstract_params(config: ModelConfig, dtype: Any) -> Params:
    """The params pytree as jax.ShapeDtypeStruct leaves (for AOT lowering and layout checks)."""
    c = config
    d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
    n, k = c.num_attention_heads, c.num_key_value_heads

    def leaf(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

    tree: dict[str, Any] = {"embed_tokens": {"embedding": leaf(c.vocab_size, d)}}
    for i in range(c.num_hidden_layers):
        attn: dict[str, Any] = {"qkv_proj": {"kernel": leaf(d, (n + 2 * k) * h)},
                                "o_proj": {"kernel": leaf(n * h, d)}}
        if c.attention_bias:
            attn["qkv_proj"]["bias"] = leaf((n + 2 * k) * h)
        if has_o_proj_bias(c):
            attn["o_proj"]["bias"] = leaf(d)
        if c.qk_norm:
            attn["q_norm"] = {"weight": leaf(h)}
            attn["k_norm"] = {"weight": leaf(h)}
        tree[f"layers_{i}"] = {
            "input_layernorm": {"weight": leaf(d)},
            "self_attn": attn,
            "post_attention_layernorm": {"weight": leaf(d)},
            "mlp": {"gate_up_proj": {"kernel": leaf(d, 2 * f)},
                    "down_proj": {"kernel": leaf(f, d)}},
        }
    tree["norm"] = {"weight": leaf(d)}
    if not c.tie_word_embeddings:
        tree["lm_head"] = {"kernel": leaf(d, c.vocab_size)}
    return tree


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: Any, *,
                   on_host: bool = False) -> Params:
    """HF-named tensors (Linear weights [out, in]) -> params in `dtype`.

    `on_host`: numpy leaves, placed nowhere yet (a tensor-parallel engine places each device's
    slice itself: jaxserve/parallel/sharding.py); else jax arrays on the default device.

    Raises ValueError naming the tensor when one is missing, has the wrong shape, or is left over
    (a leftover tensor means the config does not describe the checkpoint, e.g. an MLP bias).
    """
    c = config
    d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
    n, k = c.num_attention_heads, c.num_key_value_heads
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} (expected shape {shape} for {c.model_type})")
        array = tensors[name]
        if not isinstance(array, QuantizedTensor):
            array = np.asarray(array)
        if tuple(array.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {array.shape}, the config expects {shape}")
        used.add(name)
        return array

    def out(array: np.ndarray) -> jax.Array:
        if on_host:
            return np.asarray(array).astype(jnp.dtype(dtype), copy=False)
        return jnp.asarray(array, dtype=dtype)

    def linear(*parts: tuple[str, int, int]) -> dict[str, jax.Array]:
        # HF [out, in] weights (name, out, in), fused along out -> {"kernel": [in, sum(out)]}
        # or the quantized leaves of the same projection
        weights = [get(name, (o, i)) for name, o, i in parts]
        if any(isinstance(w, QuantizedTensor) for w in weights):
            return quantized_leaves(weights, dtype, on_host)
        return {"kernel": out(np.concatenate([w.T for w in weights], axis=1))}

    params: dict[str, Any] = {"embed_tokens": {"embedding": out(get("model.embed_tokens.weight",
                                                                    (c.vocab_size, d)))}}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        qkv = linear((a + "q_proj.weight", n * h, d), (a + "k_proj.weight", k * h, d),
                     (a + "v_proj.weight", k * h, d))                          # [D, (N+2K)H]
        attn: dict[str, Any] = {"qkv_proj": qkv, "o_proj": linear((a + "o_proj.weight", d, n * h))}
        if c.attention_bias:
            attn["qkv_proj"]["bias"] = out(np.concatenate([get(a + "q_proj.bias", (n * h,)),
                                                           get(a + "k_proj.bias", (k * h,)),
                                                           get(a + "v_proj.bias", (k * h,))]))
        if has_o_proj_bias(c):
            attn["o_proj"]["bias"] = out(get(a + "o_proj.bias", (d,)))
        if c.qk_norm:
            attn["q_norm"] = {"weight": out(get(a + "q_norm.weight", (h,)))}
            attn["k_norm"] = {"weight": out(get(a + "k_norm.weight", (h,)))}
        m = p + "mlp."
        gate_up = linear((m + "gate_proj.weight", f, d), (m + "up_proj.weight", f, d))  # [D, 2F]
        params[f"layers_{i}"] = {
            "input_layernorm": {"weight": out(get(p + "input_layernorm.weight", (d,)))},
            "self_attn": attn,
            "post_attention_layernorm": {
                "weight": out(get(p + "post_attention_layernorm.weight", (d,)))},
            "mlp": {"gate_up_proj": gate_up, "down_proj": linear((m + "down_proj.weight", d, f))},
        }
    params["norm"] = {"weight": out(get("model.norm.weight", (d,)))}
    if c.tie_word_embeddings:
        used.add("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    else:
        lm_head = get("lm_head.weight", (c.vocab_size, d))
        if isinstance(lm_head, QuantizedTensor):
            raise ValueError("lm_head.weight is quantized; jaxserve keeps the LM head in float")
        params["lm_head"] = {"kernel": out(lm_head.T)}

    leftover = sorted(name for name in tensors
                      if name not in used and not name.endswith(_IGNORED_SUFFIXES))
    if leftover:
        shown = ", ".join(repr(name) for name in leftover[:5])
        more = f" and {len(leftover) - 5} more" if len(leftover) > 5 else ""
        raise ValueError(f"tensors the {c.model_type} config does not use: {shown}{more}")
    return params


def quantized_leaves(weights: list, dtype: Any, on_host: bool = False) -> dict[str, jax.Array]:
    """HF [out, in] parts of one fused projection, at least one quantized -> its params leaves
    ([in, out] orientation, parts side by side along out; w8a8's qweight stays [out, in], the
    orientation its int8 dot runs fastest in on XLA:CPU). Float parts are requantized to the
    quantized parts' form (a GGUF may mix block types within a layer)."""
    from jaxserve.quant.fuse import fuse_quantized

    put = (lambda a, dt=None: np.asarray(a, None if dt is None else np.dtype(dt))) if on_host else jnp.asarray
    fused = fuse_quantized(weights)                      # one QuantizedTensor [sum(out), in]
    w8a8 = fused.act_smooth is not None
    leaves = {"qweight": put(fused.qweight if w8a8 else np.ascontiguousarray(fused.qweight.T)),
              "scale": put(np.ascontiguousarray(fused.scale.T), jnp.float32)}
    if w8a8:
        leaves["act_smooth"] = put(fused.act_smooth, jnp.float32)
    if fused.offset is not None:
        leaves["offset"] = put(np.ascontiguousarray(fused.offset.T), jnp.float32)
    if fused.kind == "fp8":
        leaves["act_scale"] = put(1.0 if fused.act_scale is None else fused.act_scale, jnp.float32)
    del dtype                                            # leaves keep their own dtypes
    return leaves


def init_random_params(config: ModelConfig, key: jax.Array, dtype: Any,
                       scale: float = 0.02) -> Params:
    """Random weights in the layout above: norms at 1, everything else N(0, scale^2).

    For speed checks without a checkpoint; a large `scale` (about 0.1-0.3 for tiny models) keeps
    greedy choices away from near-ties. Sampled on the host with numpy, seeded from `key`:
    jax.random compiles a sampler per distinct shape, about a second each on a busy CPU, which
    costs more than sampling itself up to SmolLM2-sized models (~1 s for 135M parameters).
    """
    rng = np.random.default_rng(_seed_from(key))
    shapes = abstract_params(config, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    values = []
    for path, spec in leaves:
        if len(path) > 1 and str(path[-2].key).endswith("norm"):
            values.append(jnp.asarray(np.ones(spec.shape, np.float32), dtype=spec.dtype))
        else:
            sample = rng.standard_normal(spec.shape, dtype=np.float32)
            sample *= np.float32(scale)
            values.append(jnp.asarray(sample, dtype=spec.dtype))
    return jax.tree_util.tree_unflatten(treedef, values)


def _seed_from(key: Any) -> list[int]:
    """A typed jax key, a raw uint32 key (jax.random.PRNGKey) or an int -> numpy seed words."""
    if isinstance(key, int):
        return [key]
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key).ravel().astype(np.uint64).tolist()
