"""Every parameter's PartitionSpec over the ("data", "model") mesh, and placement shard by shard.

Megatron's split, one all-reduce after attention and one after the MLP per layer:

    qkv_proj, gate_up_proj   column-parallel: [D, out] split on out (whole heads, layout.py)
    o_proj, down_proj        row-parallel:    [in, D] split on in; XLA sums the partial products
    embedding, lm_head       split by vocabulary when S divides V, else replicated
    norms, o/down biases     replicated (the bias is added once, after the sum)

The vocabulary split: the embedding and the tied or untied LM head are a large share of a small
model (SmolLM2-135M: 28 M of 135 M parameters) and of an 8B one (1 B of 8 B), and a split
costs two small collectives per step (the looked-up rows' all-reduce, [T, D], and the sampled
rows' logits all-gather, [R, V]) instead of a whole copy per device.

Quantized projections split the same way: `qweight` like `kernel`, group-wise `scale` /
`offset` ([G, out]) with it, a per-channel scale of a row-parallel projection ([1, out])
replicated, fp8's scalar `act_scale` replicated.

`place` builds each array from its host copy with `jax.make_array_from_callback`: every device
receives only its own slice, so no device ever holds a whole weight it does not keep.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.parallel.layout import HeadLayout
from jaxserve.parallel.mesh import MODEL_AXIS

COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
KV_ARENA_SPEC = P(None, None, MODEL_AXIS, None)      # [num_blocks, block_size, K', H]: heads split


def vocab_is_split(vocab_size: int, shards: int) -> bool:
    return vocab_size % shards == 0


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], vocab_split: bool) -> P:
    """The PartitionSpec of the leaf at `path` (keys from the root, e.g. ("layers_0",
    "self_attn", "qkv_proj", "kernel")) of the given shape."""
    module, leaf = (path[-2] if len(path) > 1 else ""), path[-1]
    if leaf == "act_scale":
        return P()
    if module in COLUMN_PARALLEL:
        return P(*([None] * (len(shape) - 1)), MODEL_AXIS)
    if module in ROW_PARALLEL:
        if leaf == "bias" or shape[0] == 1:          # bias, per-channel scale: after the sum
            return P()
        return P(MODEL_AXIS, None)
    if module == "embed_tokens":
        return P(MODEL_AXIS, None) if vocab_split else P()
    if module == "lm_head":
        return P(None, MODEL_AXIS) if vocab_split else P()
    if path[0] == "kv_scales":                        # [L, K']: per KV head
        return P(None, MODEL_AXIS)
    return P()                                        # norms


def param_shardings(params, mesh: Mesh, vocab_size: int):
    """A pytree of NamedShardings matching `params` (host arrays or ShapeDtypeStructs)."""
    split = vocab_is_split(vocab_size, mesh.shape[MODEL_AXIS])

    shards = mesh.shape[MODEL_AXIS]

    def one(path, leaf):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        spec = param_spec(keys, tuple(leaf.shape), split)
        for axis, name in enumerate(spec):
            if name == MODEL_AXIS and leaf.shape[axis] % shards:
                # a group-wise quantized row-parallel projection: its groups along the input must split evenly
                raise ValueError(f"{'/'.join(keys)} has {leaf.shape[axis]} rows (quantization groups along the "
                                 f"input), which tensor_parallel_size={shards} does not divide; use a size that "
                                 f"divides it, or a smaller quantization group")
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, params)


def to_shard_major(params: dict, layout: HeadLayout) -> dict:
    """Single-device host params -> the tensor-parallel layout (layout.py): fused columns
    reordered shard by shard, KV heads (and a quantized KV cache's scales) replicated."""
    qkv, gate_up = layout.qkv_columns(), layout.gate_up_columns()
    out: dict[str, Any] = {}
    for name, sub in params.items():
        if name.startswith("layers_"):
            sub = {**sub,
                   "self_attn": {**sub["self_attn"],
                                 "qkv_proj": _take_columns(sub["self_attn"]["qkv_proj"], qkv)},
                   "mlp": {**sub["mlp"], "gate_up_proj": _take_columns(sub["mlp"]["gate_up_proj"], gate_up)}}
        elif name == "kv_scales":
            heads = layout.original_kv_head()
            sub = {k: np.asarray(v)[:, heads] for k, v in sub.items()}
        out[name] = sub
    return out


def _take_columns(projection: dict, columns: np.ndarray) -> dict:
    # every leaf but the scalar act_scale has the output columns as its last axis
    return {k: (v if k == "act_scale" else np.ascontiguousarray(np.asarray(v)[..., columns]))
            for k, v in projection.items()}


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array with `sharding` from its host copy, each device given only its slice."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_params(host_params, mesh: Mesh, vocab_size: int):
    shardings = param_shardings(host_params, mesh, vocab_size)
    return jax.tree.map(place, host_params, shardings)


def arena_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_ARENA_SPEC)


def planned_bytes_per_device(abstract_params, shards: int, vocab_size: int) -> int:
    """Bytes one device would hold of params given as ShapeDtypeStructs (nothing allocated)."""
    split = vocab_is_split(vocab_size, shards)
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        total += nbytes // shards if MODEL_AXIS in param_spec(keys, tuple(leaf.shape), split) else nbytes
    return total


def bytes_on_each_device(arrays) -> dict[int, int]:
    """device id -> bytes of `arrays`' shards stored there (measured from the shards themselves)."""
    held: dict[int, int] = {}
    for leaf in jax.tree.leaves(arrays):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held
