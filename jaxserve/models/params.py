"""The params pytree: built from an architecture's declared tensors (models/tensor_layout.py).

Every leaf is a jnp array in the model dtype; a projection's module holds `kernel` [in, out]
(its HF weights transposed, fused parts side by side along out) and `bias` [out]; any other
tensor sits under its declared leaf name (`embed_tokens/embedding` [V, D], norms' `weight`, an
untied `lm_head/kernel` [D, V]). For the Llama family:

    embed_tokens/embedding               [V, D]   (also the LM head when tied)
    layers_{i}/input_layernorm/weight    [D]
    layers_{i}/self_attn/qkv_proj/kernel [D, (N + 2K) * H]   columns: q | k | v
    layers_{i}/self_attn/qkv_proj/bias   [(N + 2K) * H]      (attention_bias)
    layers_{i}/self_attn/q_norm/weight   [H]                 (qk_norm; k_norm likewise)
    layers_{i}/self_attn/o_proj/kernel   [N * H, D]          (+ bias: Llama/Qwen3 attention_bias)
    layers_{i}/post_attention_layernorm/weight [D]
    layers_{i}/mlp/gate_up_proj/kernel   [D, 2F]             columns: gate | up
    layers_{i}/mlp/down_proj/kernel      [F, D]
  a mixture-of-experts layer (registry.moe_layout) in place of the MLP's projections:
    layers_{i}/mlp/gate/kernel           [D, E]   the router, float
    layers_{i}/mlp/experts/gate_up/kernel [E, D, 2F']  columns gate | up, per expert
    layers_{i}/mlp/experts/down/kernel   [E, F', D]
    norm/weight                          [D]
    lm_head/kernel                       [D, V]   (untied only)

A quantized checkpoint gives its projections `qweight` / `scale` (/ `offset`, `act_scale`,
`act_smooth`) leaves in place of `kernel`, in the same [in, out] orientation but for w8a8's
qweight, [out, in] (models/linear.py); embedding and norms are always float, and so is the LM head
but in w8a8 with quantize_lm_head: then `lm_head` holds w8a8's qweight [V, D], scale [1, V] and
act_smooth [D] (the checkpoint's quantized `lm_head.weight`), beside a tied embedding.

Per-layer subtrees, never stacked [L, ...] arrays, and fused projections: the forms XLA:CPU runs
fastest (docs/facts.md).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import registry
from jaxserve.models.config import ModelConfig
from jaxserve.models.quantized_tensor import QuantizedTensor
from jaxserve.models.tensor_layout import ExpertProjection, Projection, TensorLayout

QUANTIZED_LM_HEAD = "lm_head.weight"    # where a quantized LM head sits, tied model or not

Params = dict  # pytree of jnp arrays, laid out as above


def layout_of(config: ModelConfig) -> TensorLayout:
    return registry.for_config(config).layout(config)


def _nest(tree: dict, path: tuple[str, ...], value: dict) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree.setdefault(path[-1], {}).update(value)


def abstract_params(config: ModelConfig, dtype: Any) -> Params:
    """The params pytree as jax.ShapeDtypeStruct leaves (for AOT lowering and layout checks)."""
    def leaf(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

    tree: dict[str, Any] = {}
    for path, spec in layout_of(config).modules.items():
        if isinstance(spec, ExpertProjection):
            leaves = {"kernel": leaf(spec.num_experts, spec.in_features, spec.out_features)}
        elif isinstance(spec, Projection):
            leaves = {"kernel": leaf(spec.in_features, spec.out_features)}
            if spec.bias:
                leaves["bias"] = leaf(spec.out_features)
        else:
            leaves = {spec.leaf: leaf(*spec.shape)}
        _nest(tree, path, leaves)
    return tree


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: Any, *,
                   on_host: bool = False) -> Params:
    """HF-named tensors (Linear weights [out, in]) -> params in `dtype`.

    `on_host`: numpy leaves, placed nowhere yet (a tensor-parallel engine places each device's
    slice itself: jaxserve/parallel/sharding.py); else jax arrays on the default device.

    Raises ValueError naming the tensor when one is missing, has the wrong shape, or is left over
    (a leftover tensor means the config does not describe the checkpoint, e.g. an MLP bias).
    """
    layout = layout_of(config)
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"missing tensor {name!r} (expected shape {shape} for {config.model_type})")
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

    params: dict[str, Any] = {}
    head = tensors.get(QUANTIZED_LM_HEAD)
    if isinstance(head, QuantizedTensor):
        # w8a8's LM head (quant/checkpoint.py): its own leaves, beside a tied embedding kept float
        params["lm_head"] = quantized_leaves([get(QUANTIZED_LM_HEAD, (config.vocab_size, config.hidden_size))],
                                             dtype, on_host)
    for path, spec in layout.modules.items():
        if path == ("lm_head",) and "lm_head" in params:
            continue
        if isinstance(spec, ExpertProjection):
            # every expert's parts fused as a Projection's, the experts stacked first
            per_expert = [projection_leaves([get(n, s) for n, s in spec.expert_weights(e).items()], dtype, on_host)
                          for e in range(spec.num_experts)]
            stack = np.stack if on_host else jnp.stack
            leaves = {k: stack([leaves[k] for leaves in per_expert]) for k in per_expert[0]}
        elif isinstance(spec, Projection):
            # HF [out, in] parts fused along out -> {"kernel": [in, sum(out)]}, or quantized leaves
            weights = [get(name, shape) for name, shape in spec.hf_weights().items()]
            if any(isinstance(w, QuantizedTensor) for w in weights):
                leaves = quantized_leaves(weights, dtype, on_host)
            else:
                leaves = {"kernel": out(np.concatenate([w.T for w in weights], axis=1))}
            if spec.bias:
                leaves["bias"] = out(np.concatenate([get(name, shape) for name, shape in spec.hf_biases().items()]))
        else:
            array = get(spec.hf_name, spec.hf_shape)
            if isinstance(array, QuantizedTensor):
                raise ValueError(f"{spec.hf_name} is quantized; jaxserve keeps it in float")
            leaves = {spec.leaf: out(array.T if spec.transpose else array)}
        _nest(params, path, leaves)
    if layout.tied_lm_head is not None:
        used.add(layout.tied_lm_head)  # some tied checkpoints store the shared matrix twice

    leftover = sorted(name for name in tensors
                      if name not in used and not name.endswith(layout.ignored_suffixes))
    if leftover:
        shown = ", ".join(repr(name) for name in leftover[:5])
        more = f" and {len(leftover) - 5} more" if len(leftover) > 5 else ""
        raise ValueError(f"tensors the {config.model_type} config does not use: {shown}{more}")
    return params


def projection_leaves(weights: list, dtype: Any, on_host: bool = False) -> dict:
    """HF [out, in] parts of one fused projection (float or quantized) -> its leaves, no bias."""
    if any(isinstance(w, QuantizedTensor) for w in weights):
        return quantized_leaves(weights, dtype, on_host)
    fused = np.concatenate([np.asarray(w).T for w in weights], axis=1)
    return {"kernel": fused.astype(jnp.dtype(dtype), copy=False) if on_host else jnp.asarray(fused, dtype=dtype)}


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
    """Random weights in the layout above: a tensor declared with a `fill` (norms: 1, or 0 for a
    `(1 + w)` norm) holds that value, everything else N(0, scale^2).

    For speed checks without a checkpoint; a large `scale` (about 0.1-0.3 for tiny models) keeps
    greedy choices away from near-ties. Sampled on the host with numpy, seeded from `key`:
    jax.random compiles a sampler per distinct shape, about a second each on a busy CPU, which
    costs more than sampling itself up to SmolLM2-sized models (~1 s for 135M parameters).
    """
    rng = np.random.default_rng(_seed_from(key))
    layout = layout_of(config)
    shapes = abstract_params(config, dtype)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    values = []
    for path, leaf in leaves:
        spec = layout.spec_of(tuple(str(k.key) for k in path))
        fill = getattr(spec, "fill", None)
        if fill is not None:
            values.append(jnp.full(leaf.shape, fill, dtype=leaf.dtype))
        else:
            sample = rng.standard_normal(leaf.shape, dtype=np.float32)
            sample *= np.float32(scale)
            values.append(jnp.asarray(sample, dtype=leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, values)


def _seed_from(key: Any) -> list[int]:
    """A typed jax key, a raw uint32 key (jax.random.PRNGKey) or an int -> numpy seed words."""
    if isinstance(key, int):
        return [key]
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return np.asarray(key).ravel().astype(np.uint64).tolist()
