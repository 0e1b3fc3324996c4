"""In-place weight updates: new weights for a running engine, checked, converted and placed where
the old ones live, so that the compiled steps (which take the params as an argument) run on them
without compiling anything. The engine swaps them in between steps (Engine.update_weights).

Two forms of update (`new_params`):

- **A pytree** with exactly the structure, shapes and dtypes of the runner's params
  (`engine.runner.params`; for a model brought from outside jaxserve, models/custom.py, its own
  params pytree). It is the engine's own layout: on a tensor-parallel engine the fused
  projections' columns are shard-major and the KV heads replicated, as `runner.params` holds them
  (parallel/layout.py). The runner's own leaves (`kv_scales`, a quantized KV cache's scales) may
  be left out: the ones the engine has are kept, and so may LoRA slots (`lora_a`, `lora_b` beside
  a projection's weight, lora/slot_layout.py): the resident adapters stay.
- **(HF tensor name, array) pairs** with the checkpoint's names, in the checkpoint's single-device
  layout and orientation (linear weights [out, in]), as models/params.py converts them at load;
  on a tensor-parallel engine the shard-major reorder (parallel/sharding.py `to_shard_major`) is
  applied here. A partial update is fine: only the params leaves whose tensors are named are
  replaced, but a fused leaf is all or nothing (q, k and v for `qkv_proj/kernel`, gate and up for
  `gate_up_proj/kernel`; biases likewise). The conversion runs on the host (numpy), so jax arrays
  given in this form are copied to the host first: the pytree form is the one without copies.

Placement: a jax.Array that already has the target leaf's sharding and dtype is used as it is
(the engine then holds the very buffer the caller passed: do not donate or delete it afterwards);
anything else is `jax.device_put` onto the target's sharding. Every check runs before anything is
replaced, and each error is a ValueError naming the leaf or tensor.

A quantized engine (quantization != none) takes the pytree form quantized as `runner.params`
holds it, or the named form complete (every tensor of the checkpoint, in float): it runs the
quantization pass that built it (engine/builder.py `checkpoint_params`) on them, calibrating
again in a calibrated mode. Not built: a partial named update of a quantized engine (it keeps no
float copy to fill the rest from) and the named form for custom models (no checkpoint names).

What an update does to the requests that hold KV (Scheduler.recompute_all, sched/preemption.py):
they go back to the waiting queue to be recomputed under the new weights, as a preemption by
recompute leaves them; the prefix cache is flushed (Engine.update_weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jaxserve.models import custom
from jaxserve.models.params import layout_of
from jaxserve.models.tensor_layout import ExpertProjection, Projection, TensorLayout
from jaxserve.parallel.layout import HeadLayout
from jaxserve.parallel.mesh import MODEL_AXIS
from jaxserve.parallel.sharding import RUNNER_LEAVES, to_shard_major

QUANTIZED_LEAVES = ("qweight", "scale", "offset", "act_scale", "act_smooth")


def new_params(runner, update: Any, *, requantize: Callable[[dict], Any] | None = None) -> Any:
    """The runner's params with `update` applied (see the module docstring), placed on the
    runner's shardings. Changes nothing on the runner. `requantize`: a quantized engine's pass
    from a complete set of checkpoint-named float tensors to its params (engine/builder.py)."""
    current = runner.params
    if isinstance(runner.model, custom.CustomModelAdapter):
        if _is_named(update):
            raise ValueError("a custom model's weights are updated with the pytree of its own params (the one "
                             "LLM(model=CustomModel(...), params=...) took), not with checkpoint tensor names")
        return {custom.PARAMS_KEY: from_pytree(current[custom.PARAMS_KEY], update)}
    if _is_named(update) and _is_quantized(current):
        return with_lora_slots(current, from_named_quantized(runner, current, update, requantize))
    if _is_named(update):
        return from_named(runner, current, update)
    if isinstance(update, Mapping) and isinstance(current, Mapping):
        # the runner's own leaves may be left out: the engine's are kept
        kept = {k: current[k] for k in RUNNER_LEAVES if k in current and k not in update}
        update = with_lora_slots(current, {**update, **kept})
    return from_pytree(current, update)


LORA_LEAVES = ("lora_a", "lora_b")


def with_lora_slots(current: Mapping, update: Mapping) -> Mapping:
    """`update` with the engine's LoRA slot arrays (lora/slot_layout.py) wherever it leaves them
    out: an update replaces base weights, and the adapters resident in the slots stay."""
    if not isinstance(current, Mapping) or not isinstance(update, Mapping):
        return update
    out = dict(update)
    for key, node in current.items():
        if key in LORA_LEAVES and key not in out:
            out[key] = node
        elif isinstance(node, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = with_lora_slots(node, out[key])
    return out


def _is_named(update: Any) -> bool:
    """(name, array) pairs (a list, a generator, dict.items()) rather than a pytree."""
    if isinstance(update, Mapping):
        return False
    return isinstance(update, Iterable) and not isinstance(update, (str, bytes, np.ndarray, jax.Array))


def _is_quantized(current) -> bool:
    return any(_keys(path)[-1] in QUANTIZED_LEAVES and _keys(path)[0] not in RUNNER_LEAVES
               for path, _ in jax.tree_util.tree_flatten_with_path(current)[0])


def from_named_quantized(runner, current: dict, pairs: Iterable, requantize) -> dict:
    """A quantized engine's update by name: every tensor of the checkpoint, in float, quantized
    here by the pass that built the engine (a calibrated mode calibrates again on the new weights;
    a quantized KV cache keeps the scales it started with). A partial update is refused: the
    engine keeps no float copy to fill the rest from."""
    if requantize is None:
        raise ValueError("this quantized engine cannot quantize an update (it was not built from a checkpoint); "
                         "pass its params pytree, quantized as engine.runner.params holds them")
    tensors = _named_dict(pairs)
    layout = layout_of(runner.model_config)
    needed = [n for n in layout.hf_shapes() if n != layout.tied_lm_head]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ValueError(f"a quantized engine takes complete updates (it quantizes every projection again): "
                         f"{missing[0]!r} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    new = requantize({n: np.asarray(a) for n, a in tensors.items()})
    kept = {k: current[k] for k in RUNNER_LEAVES if k in current}
    return from_pytree(current, {**{k: v for k, v in new.items() if k not in RUNNER_LEAVES}, **kept})


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _name(path) -> str:
    return "/".join(_keys(path)) or "<root>"


# -- the pytree form ---------------------------------------------------------------------------
def from_pytree(current: Any, update: Any) -> Any:
    """`update` checked leaf by leaf against `current` (structure, shape, dtype) and placed on
    `current`'s shardings."""
    cur_leaves, cur_def = jax.tree_util.tree_flatten_with_path(current)
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(update)
    if new_def != cur_def:
        have = {_name(p) for p, _ in new_leaves}
        want = {_name(p) for p, _ in cur_leaves}
        missing, extra = sorted(want - have), sorted(have - want)
        if missing or extra:
            parts = ([f"missing leaves {missing[:5]}"] if missing else []) + (
                [f"unknown leaves {extra[:5]}"] if extra else [])
            raise ValueError(f"the params pytree does not have the engine's structure: {'; '.join(parts)}")
        raise ValueError(f"the params pytree has the engine's leaf names but another structure "
                         f"(container types differ): {new_def} vs the engine's {cur_def}")
    placed = []
    for (path, old), (_, new) in zip(cur_leaves, new_leaves):
        name = _name(path)
        if not hasattr(new, "shape") or not hasattr(new, "dtype"):
            raise ValueError(f"params leaf {name} is a {type(new).__name__}, not an array")
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"params leaf {name} has shape {tuple(new.shape)}, the engine's has {tuple(old.shape)}")
        if np.dtype(new.dtype) != np.dtype(old.dtype):
            raise ValueError(f"params leaf {name} has dtype {new.dtype}, the engine's is {old.dtype} "
                             f"(cast it first: the compiled steps take exactly the engine's dtypes)")
        placed.append(place_like(new, old))
    return jax.tree_util.tree_unflatten(cur_def, placed)


def place_like(x: Any, target: jax.Array) -> jax.Array:
    """`x` on `target`'s sharding: as it is when it is a jax.Array there already, else device_put."""
    sharding = target.sharding
    if isinstance(x, jax.Array) and x.dtype == target.dtype and _same_placement(x.sharding, sharding, x.ndim):
        return x
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def _same_placement(a, b, ndim: int) -> bool:
    try:
        return a == b or a.is_equivalent_to(b, ndim)
    except Exception:   # noqa: BLE001 - shardings of other kinds: treat as different, device_put decides
        return False


# -- the named form ----------------------------------------------------------------------------
def from_named(runner, current: dict, pairs: Iterable) -> dict:
    """HF-named tensors -> `current` with the leaves they name replaced (see the module docstring)."""
    tensors = _named_dict(pairs)
    config, heads = checkpoint_config(runner, tensors)
    layout = layout_of(config)
    known = layout.hf_shapes()
    unknown = [n for n in tensors if n not in known and not n.endswith(layout.ignored_suffixes)
               and n != layout.tied_lm_head]
    if unknown:
        raise ValueError(f"unknown tensor {unknown[0]!r}: the {config.model_type} checkpoint has no such name"
                         + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    if layout.tied_lm_head in tensors and layout.tied_lm_head not in known:
        embed = next((w.hf_name for _, w in layout.weights() if w.leaf == "embedding"), None)
        if embed not in tensors:
            raise ValueError(f"{layout.tied_lm_head!r}: this model ties its LM head to {embed!r}; update that tensor")

    host: dict[str, Any] = {}
    modules: dict = {}
    for path, spec in layout.modules.items():
        first = "kernel" if isinstance(spec, (Projection, ExpertProjection)) else spec.leaf
        leaves = _module_leaves(spec, tensors, np.dtype(_leaf(current, path + (first,)).dtype))
        if leaves:
            _nest(host, path, leaves)
            modules[path] = spec
    if heads is not None:   # tensor parallel: the engine's fused columns are shard-major
        host = to_shard_major(host, heads, TensorLayout(modules=modules))

    out = _copy_dicts(current)
    for path, leaf in jax.tree_util.tree_flatten_with_path(host)[0]:
        keys = _keys(path)
        old = _leaf(current, keys)
        if tuple(leaf.shape) != tuple(old.shape):
            raise ValueError(f"params leaf {'/'.join(keys)} would get shape {tuple(leaf.shape)} from the named "
                             f"tensors, the engine's has {tuple(old.shape)}")
        tree = out
        for k in keys[:-1]:
            tree = tree[k]
        tree[keys[-1]] = place_like(np.ascontiguousarray(leaf).astype(old.dtype, copy=False), old)
    return out


def _named_dict(pairs: Iterable) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for item in pairs:
        try:
            name, array = item
        except (TypeError, ValueError):
            raise ValueError(f"a named update is (HF tensor name, array) pairs; got {type(item).__name__}") from None
        if not isinstance(name, str):
            raise ValueError(f"tensor name {name!r} is not a str")
        if name in tensors:
            raise ValueError(f"tensor {name!r} is named twice")
        tensors[name] = array
    if not tensors:
        raise ValueError("the update names no tensors")
    return tensors


def _module_leaves(spec, tensors: Mapping[str, Any], dtype: np.dtype) -> dict[str, np.ndarray]:
    """The params leaves of one module from the tensors named (only the leaves fully named)."""
    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = np.asarray(tensors[name])
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)}, the model's is {tuple(shape)}")
        return array

    def group(names: dict[str, tuple]) -> list[np.ndarray] | None:
        given = [n for n in names if n in tensors]
        if not given:
            return None
        if len(given) != len(names):
            missing = [n for n in names if n not in tensors]
            raise ValueError(f"tensor {missing[0]!r} is missing: the engine fuses {list(names)} into one leaf, "
                             f"so an update names all of them or none")
        return [get(n, s) for n, s in names.items()]

    if isinstance(spec, ExpertProjection):      # every expert's weights or none: one stacked leaf
        weights = group(spec.hf_weights())
        if weights is None:
            return {}
        per = len(spec.parts)
        return {"kernel": np.stack([np.concatenate([w.T for w in weights[e * per:(e + 1) * per]], axis=1)
                                    for e in range(spec.num_experts)]).astype(dtype, copy=False)}
    if isinstance(spec, Projection):
        leaves = {}
        weights = group(spec.hf_weights())
        if weights is not None:
            leaves["kernel"] = np.concatenate([w.T for w in weights], axis=1).astype(dtype, copy=False)
        biases = group(spec.hf_biases()) if spec.bias else None
        if biases is not None:
            leaves["bias"] = np.concatenate(biases).astype(dtype, copy=False)
        return leaves
    if spec.hf_name not in tensors:
        return {}
    array = get(spec.hf_name, spec.hf_shape)
    return {spec.leaf: (array.T if spec.transpose else array).astype(dtype, copy=False)}


def checkpoint_config(runner, tensors: Mapping[str, Any]):
    """The model config as the checkpoint describes it, and the tensor-parallel head layout (None
    on one device). A tensor-parallel runner's config counts the replicated KV heads K' = max(K, S)
    (parallel/layout.py); K itself is K' unless K' == S, where the update's k projection says
    (and with no k projection in the update, K changes no shape the update touches)."""
    config = runner.model_config
    if runner.mesh is None:
        return config, None
    shards = runner.mesh.shape[MODEL_AXIS]
    kv = config.num_key_value_heads
    if kv == shards:
        for _, spec in layout_of(config).projections():
            if spec.shard_major == "qkv":
                k = tensors.get(f"{spec.parts[1][0]}.weight")
                if k is not None:
                    kv = np.shape(k)[0] // config.head_dim
                    break
    original = dataclasses.replace(config, num_key_value_heads=kv)
    heads = HeadLayout.for_model(original, shards)
    if heads.kv_heads != config.num_key_value_heads:
        raise ValueError(f"the update's k projection has {kv} KV heads; the engine runs "
                         f"{config.num_key_value_heads} (after replication over {shards} shards)")
    return original, heads


def _leaf(tree, keys):
    for k in keys:
        tree = tree[k]
    return tree


def _nest(tree: dict, path: tuple[str, ...], value: dict) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree.setdefault(path[-1], {}).update(value)


def _copy_dicts(tree):
    return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


# -- from a checkpoint on disk -----------------------------------------------------------------
def checkpoint_tensors(path: str, *, cache_dir: str | None = None) -> dict[str, Any]:
    """The tensors of a checkpoint on disk (an HF directory, a GGUF file, a converted directory:
    checkpoints/loader.py), HF-named, for the named form of an update. What a trainer that saves
    with `save_pretrained` hands to a server's update control call. Runs on the caller's thread
    (the server's loads off the step thread); the tensors are checked against the engine's
    model when the update is applied."""
    from jaxserve.checkpoints.loader import load_checkpoint

    if not isinstance(path, str) or not path:
        raise ValueError(f"the checkpoint path must be a non-empty string, got {path!r}")
    return dict(load_checkpoint(path, cache_dir=cache_dir).tensors)
