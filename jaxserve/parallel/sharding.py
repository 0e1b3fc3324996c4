"""Every parameter's PartitionSpec over the ("data", "model") mesh, and placement shard by shard.

The rules are the architecture's declaration (models/tensor_layout.py, via the registry), read
per leaf from the module that holds it; Megatron's split, one all-reduce after attention and one
after the MLP per layer, for the Llama family:

    column-parallel projection   [in, out] split on out (q|k|v, gate|up: whole heads, layout.py)
    row-parallel projection      [in, out] split on in; XLA sums the partial products
    embedding, LM head           split by vocabulary (VOCAB_ROWS / VOCAB_COLUMNS) when S divides V,
                                 else replicated
    norms, row-parallel biases   replicated (the bias is added once, after the sum)
    LoRA slots                   a column-parallel projection's lora_a replicated, lora_b split on
                                 out; a row-parallel one's lora_a split on in, lora_b replicated
    stacked experts              [E, ...] split on "expert", their gate|up columns (shard-major) and
                                 down rows on "model" (parallel/experts.py, expert_leaf_spec)

The vocabulary split: the embedding and the tied or untied LM head are a large share of a small
model (SmolLM2-135M: 28 M of 135 M parameters) and of an 8B one (1 B of 8 B), and a split
costs two small collectives per step (the looked-up rows' all-reduce, [T, D], and the sampled
rows' logits all-gather, [R, V]) instead of a whole copy per device.

Quantized projections split the same way: `qweight` like `kernel`, group-wise `scale` /
`offset` ([G, out]) with it, a per-channel scale of a row-parallel projection ([1, out])
replicated, fp8's scalar `act_scale` replicated. The runner's own leaves (a quantized KV
cache's scales, [L, K']) split by KV head, like the arena.

`place` builds each array from its host copy with `jax.make_array_from_callback`: every device
receives only its own slice, so no device ever holds a whole weight it does not keep.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.models.tensor_layout import (
    COLUMN, VOCAB_COLUMNS, VOCAB_ROWS, ExpertProjection, Projection, TensorLayout, Weight,
)
from jaxserve.parallel.layout import HeadLayout, split_columns_order
from jaxserve.parallel.experts import expert_leaf_spec
from jaxserve.parallel.mesh import EXPERT_AXIS, MODEL_AXIS

KV_ARENA_SPEC = P(None, None, MODEL_AXIS, None)      # [num_blocks, block_size, K', H]: heads split
RUNNER_LEAVES = ("kv_scales",)                       # the runner's, not the checkpoint's: [L, K'] per KV head


def vocab_is_split(vocab_size: int, shards: int) -> bool:
    return vocab_size % shards == 0


def param_spec(spec: Projection | Weight, leaf: str, shape: tuple[int, ...], vocab_split: bool) -> P:
    """The PartitionSpec of the leaf named `leaf`, of the given shape, in the module `spec` declares."""
    if isinstance(spec, Projection):
        if leaf == "act_scale":
            return P()
        if leaf in ("lora_a", "lora_b"):
            # LoRA slots (lora/slot_layout.py): a [in, N, P*R], b [N, P*R, out], split with their
            # projection (column: b by output columns; row: a by input rows, the partial xa summed)
            column = spec.parallel == COLUMN
            if leaf == "lora_a":
                return P() if column else P(MODEL_AXIS, None, None)
            return P(None, None, MODEL_AXIS) if column else P()
        if spec.parallel == COLUMN:
            return P(*([None] * (len(shape) - 1)), MODEL_AXIS)
        if leaf == "bias" or shape[0] == 1:          # bias, per-channel scale: after the sum
            return P()
        return P(MODEL_AXIS, None)
    if spec.split == VOCAB_ROWS and vocab_split:
        return P(MODEL_AXIS, None)
    if spec.split == VOCAB_COLUMNS and vocab_split:
        return P(None, MODEL_AXIS)
    return P()


def leaf_spec(tensors: TensorLayout, keys: tuple[str, ...], shape: tuple[int, ...], vocab_split: bool) -> P:
    """The PartitionSpec of the params leaf at `keys` (from the root, e.g. ("layers_0",
    "self_attn", "qkv_proj", "kernel"))."""
    if keys[0] in RUNNER_LEAVES:
        return P(None, MODEL_AXIS)
    spec = tensors.spec_of(keys)
    if spec is None:
        raise ValueError(f"params leaf {'/'.join(keys)} is not in the architecture's declared tensors")
    if isinstance(spec, ExpertProjection):        # experts on "expert", their columns on "model"
        return expert_leaf_spec(keys[-2], keys[-1], shape)
    return param_spec(spec, keys[-1], shape, vocab_split)


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def param_shardings(params, mesh: Mesh, tensors: TensorLayout, vocab_size: int):
    """A pytree of NamedShardings matching `params` (host arrays or ShapeDtypeStructs)."""
    shards = mesh.shape[MODEL_AXIS]
    split = vocab_is_split(vocab_size, shards)
    _check_packed_expert_rows(params, tensors, shards)

    def one(path, leaf):
        keys = _keys(path)
        spec = leaf_spec(tensors, keys, tuple(leaf.shape), split)
        for axis, name in enumerate(spec):
            if name == EXPERT_AXIS and leaf.shape[axis] % mesh.shape[EXPERT_AXIS]:
                raise ValueError(f"{'/'.join(keys)} stacks {leaf.shape[axis]} experts, which "
                                 f"expert_parallel_size={mesh.shape[EXPERT_AXIS]} does not divide")
            if name == MODEL_AXIS and leaf.shape[axis] % shards:
                # a group-wise quantized row-parallel projection: its groups along the input must split evenly
                raise ValueError(f"{'/'.join(keys)} has {leaf.shape[axis]} rows (quantization groups along the "
                                 f"input), which tensor_parallel_size={shards} does not divide; use a size that "
                                 f"divides it, or a smaller quantization group")
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, params)


def _check_packed_expert_rows(params, tensors: TensorLayout, shards: int) -> None:
    """An int4 expert down projection splits its rows over "model" inside shard_map, where each
    device unpacks its own slice: int4 packs the two halves of a quantization group into one byte
    row (quant/int4.py), so a shard must hold whole groups. (GSPMD's dense projections unpack the
    global array and need no such rule.)"""
    if shards == 1:
        return
    for path, spec in tensors.expert_projections():
        if len(spec.parts) != 1:              # gate_up: split by columns, every group whole
            continue
        leaves = params
        for key in path:
            leaves = leaves[key]
        if "qweight" in leaves and np.dtype(leaves["qweight"].dtype) == np.uint8 and leaves["scale"].shape[1] % shards:
            groups = leaves["scale"].shape[1]
            raise ValueError(f"{'/'.join(path)}: int4 experts of {spec.in_features} intermediate columns hold "
                             f"{groups} quantization group(s) along them, which tensor_parallel_size={shards} does "
                             f"not divide (a device must unpack whole groups); use a smaller "
                             f"quantization_group_size, int8, or a tensor-parallel size that divides {groups}")


def to_shard_major(params: dict, heads: HeadLayout, tensors: TensorLayout) -> dict:
    """Single-device host params -> the tensor-parallel layout (layout.py): each fused
    column-parallel projection's columns reordered shard by shard as it declares ("qkv": whole
    heads, KV heads replicated; "split": every part cut evenly), and a quantized KV cache's scales
    replicated with their heads."""
    out: dict[str, Any] = dict(params)
    for path, spec in tensors.projections():
        if spec.shard_major is None:
            continue
        columns = (heads.qkv_columns() if spec.shard_major == "qkv"
                   else split_columns_order(tuple(n for _, n in spec.parts), heads.shards))
        *parents, name = path
        tree = out
        for key in parents:                 # copy the path down to the projection, never the source
            tree[key] = dict(tree[key])
            tree = tree[key]
        tree[name] = _take_columns(tree[name], columns)
    for path, spec in tensors.expert_projections():
        if len(spec.parts) == 1:             # down: split by rows, no reorder
            continue
        # gate | up of every expert: each shard's slice of both parts together, as gate_up_proj's
        columns = split_columns_order(tuple(n for _, n in spec.parts), heads.shards)
        *parents, name = path
        tree = out
        for key in parents:
            tree[key] = dict(tree[key])
            tree = tree[key]
        tree[name] = _take_columns(tree[name], columns)
    if "kv_scales" in out:
        original = heads.original_kv_head()
        out["kv_scales"] = {k: np.asarray(v)[:, original] for k, v in out["kv_scales"].items()}
    return out


def _take_columns(projection: dict, columns: np.ndarray) -> dict:
    # every leaf but the scalar act_scale has the output columns as its last axis
    return {k: (v if k == "act_scale" else np.ascontiguousarray(np.asarray(v)[..., columns]))
            for k, v in projection.items()}


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array with `sharding` from its host copy, each device given only its slice."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_params(host_params, mesh: Mesh, tensors: TensorLayout, vocab_size: int):
    shardings = param_shardings(host_params, mesh, tensors, vocab_size)
    return jax.tree.map(place, host_params, shardings)


def arena_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_ARENA_SPEC)


def planned_bytes_per_device(abstract_params, tensors: TensorLayout, shards: int, vocab_size: int) -> int:
    """Bytes one device would hold of params given as ShapeDtypeStructs (nothing allocated)."""
    split = vocab_is_split(vocab_size, shards)
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        sharded = MODEL_AXIS in leaf_spec(tensors, _keys(path), tuple(leaf.shape), split)
        total += nbytes // shards if sharded else nbytes
    return total


def bytes_on_each_device(arrays) -> dict[int, int]:
    """device id -> bytes of `arrays`' shards stored there (measured from the shards themselves)."""
    held: dict[int, int] = {}
    for leaf in jax.tree.leaves(arrays):
        for shard in leaf.addressable_shards:
            held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
    return held
