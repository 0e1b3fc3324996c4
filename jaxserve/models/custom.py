"""Bring your own JAX model: `CustomModel`, the protocol a model defined outside jaxserve follows
to be served by the engine (docs/custom_models.md), and the adapter the runner calls it through.

The user's model is two pure functions of its own parameter pytree, written in plain JAX, Flax
NNX or Linen (anything that traces under `jax.jit`):

    forward(params, input_ids [T] int32, positions [T] int32, kv_caches, attention)
        -> (hidden [T, D], new kv_caches)
    compute_logits(params, hidden [S, D]) -> logits [S, V] float32

`input_ids` and `positions` are a packed ragged batch: decode rows and prefill chunks of many
requests side by side, padding included. The model never sees sequence boundaries; it embeds,
applies its own RoPE at `positions`, and for each layer calls

    out, kv_caches[i] = attention(i, q [T, N, H], k [T, K, H], v [T, K, H], kv_caches[i])

with q and k already rotated. That callback is the engine's paged attention: it writes k and v
into the KV arena and attends each row over its own request's keys, with the layer's scale,
sliding window and soft cap as declared here. `kv_caches` is a list, one opaque handle per layer:
hand each to the callback and keep what it returns. Layers must be a Python loop (`i` a Python
int), not a `lax.scan` over stacked layers, since each layer's cache is its own array.

The engine runs on a `ModelConfig` with model_type "custom" (the registry's CUSTOM row) built
from the numbers declared here; `CustomModelAdapter` gives the user's functions the runner's
`forward(params, config, ...)` / `compute_logits(params, config, hidden)` shape, and
`model_identity` names the model for the executable and calibration caches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import marshal
import os
import types
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import registry
from jaxserve.models.config import FULL_ATTENTION, SLIDING_ATTENTION, LayerAttention, ModelConfig

log = logging.getLogger(__name__)

# the runner's params are {PARAMS_KEY: the user's pytree}: the step looks up its own entries
# (a quantized KV cache's "kv_scales") in a dict, and the user's pytree may be anything
PARAMS_KEY = "custom"

# attention(layer_idx, q [T, N, H], k [T, K, H], v [T, K, H], kv_cache) -> (out [T, N, H], kv_cache)
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@dataclass(frozen=True)
class CustomModel:
    """A model defined outside jaxserve, as the engine needs to know it.

    forward(params, input_ids, positions, kv_caches, attention) -> (hidden [T, D], kv_caches)
    compute_logits(params, hidden [S, D]) -> logits [S, V] (float32; other dtypes are cast)

    Attention, per layer: softmax(soft_cap(scale * q k^T)) over the causal keys of the row's own
    request, the last `sliding_window` of them (the query's own included) on sliding layers.
      attention_scale: every layer's scale (None: head_dim ** -0.5)
      sliding_window:  the window of the sliding layers (None: no layer slides)
      sliding_layers:  which layers slide (None: every layer, when sliding_window is set)
      attn_soft_cap:   s -> cap * tanh(s / cap) on the scores of every layer (None: no cap)

    partition_specs (tensor_parallel_size > 1 only): params -> a pytree of
    `jax.sharding.PartitionSpec` of the same structure over the mesh axes ("data", "model"); the
    engine places the params by it on its ("data" 1, "model" tp) mesh. num_heads and num_kv_heads
    must divide by tensor_parallel_size.

    The executable cache keys a compiled step by `model_identity`: the numbers here, the params'
    structure, shapes and dtypes, and the Python source of the modules that define `forward` and
    `compute_logits` (a module in a package: the whole top-level package). `source_modules`
    names more modules (or packages) whose code runs inside the forward; `version` is mixed in
    as given (e.g. to tell weight versions apart: the identity never reads weight values).
    """

    forward: Callable
    compute_logits: Callable
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    attention_scale: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    attn_soft_cap: float | None = None
    name: str = "custom"
    partition_specs: Callable[[Any], Any] | None = None
    source_modules: tuple[str | types.ModuleType, ...] = ()
    version: str = ""

    def __post_init__(self) -> None:
        for fn in ("forward", "compute_logits"):
            if not callable(getattr(self, fn)):
                raise TypeError(f"CustomModel.{fn} must be callable, got {type(getattr(self, fn)).__name__}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"CustomModel.{name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"CustomModel.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        eos = self.eos_token_ids
        eos = (eos,) if isinstance(eos, (int, np.integer)) else tuple(eos)
        object.__setattr__(self, "eos_token_ids", tuple(int(e) for e in eos))
        for e in self.eos_token_ids + (() if self.bos_token_id is None else (self.bos_token_id,)):
            if not 0 <= e < self.vocab_size:
                raise ValueError(f"CustomModel: token id {e} (eos/bos) is outside the vocabulary of {self.vocab_size}")
        for name in ("attention_scale", "attn_soft_cap"):
            value = getattr(self, name)
            if value is not None and not (np.isfinite(value) and value > 0):
                raise ValueError(f"CustomModel.{name}={value!r} must be a positive number (or None)")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, (int, np.integer))
                                                or self.sliding_window <= 0):
            raise ValueError(f"CustomModel.sliding_window={self.sliding_window!r} must be a positive integer "
                             f"(or None)")
        if self.sliding_layers is not None:
            layers = tuple(int(i) for i in self.sliding_layers)
            if self.sliding_window is None:
                raise ValueError("CustomModel.sliding_layers is set but sliding_window is not")
            bad = [i for i in layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"CustomModel.sliding_layers {bad} are not layers of a {self.num_layers}-layer model")
            object.__setattr__(self, "sliding_layers", tuple(sorted(set(layers))))
        if self.partition_specs is not None and not callable(self.partition_specs):
            raise TypeError("CustomModel.partition_specs must be a callable params -> PartitionSpec pytree")
        object.__setattr__(self, "source_modules", tuple(self.source_modules))

    def layer_attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s (sm_scale, sliding_window, soft_cap), as the engine's attention runs it
        (a reference attention of the user's can read it too)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is not in [0, {self.num_layers})")
        sliding = self.sliding_window is not None and (self.sliding_layers is None or layer in self.sliding_layers)
        scale = self.head_dim ** -0.5 if self.attention_scale is None else float(self.attention_scale)
        return LayerAttention(sm_scale=scale, sliding_window=int(self.sliding_window) if sliding else None,
                              soft_cap=None if self.attn_soft_cap is None else float(self.attn_soft_cap))

    def numbers(self) -> dict:
        """What the engine knows of the model beyond its functions (part of its identity)."""
        skip = {"forward", "compute_logits", "partition_specs", "source_modules"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


def model_config(model: CustomModel, hidden_size: int) -> ModelConfig:
    """The engine's ModelConfig of a custom model: model_type "custom", its sizes, and its
    attention mapped onto layer_types / sliding_window / query_pre_attn_scalar /
    attn_logit_softcap, so that `config.layer_attention(i)` is `model.layer_attention(i)`.
    The fields of jaxserve's own models that the engine never reads for a custom one
    (intermediate_size, rms_norm_eps, rope_theta, ...) hold placeholders."""
    if model.sliding_window is None:
        layer_types = None
    else:
        layer_types = tuple(SLIDING_ATTENTION if model.layer_attention(i).sliding_window else FULL_ATTENTION
                            for i in range(model.num_layers))
    scale = model.attention_scale
    fields = dict(
        model_type=registry.CUSTOM_MODEL_TYPE,
        vocab_size=int(model.vocab_size),
        hidden_size=int(hidden_size),
        intermediate_size=int(hidden_size),      # not read for a custom model
        num_hidden_layers=int(model.num_layers),
        num_attention_heads=int(model.num_heads),
        num_key_value_heads=int(model.num_kv_heads),
        head_dim=int(model.head_dim),
        rms_norm_eps=0.0,                        # the model's own
        rope_theta=0.0,                          # the model applies its own RoPE
        max_position_embeddings=int(model.max_position_embeddings),
        tie_word_embeddings=False,
        bos_token_id=model.bos_token_id,
        eos_token_ids=model.eos_token_ids,
        sliding_window=None if model.sliding_window is None else int(model.sliding_window),
        layer_types=layer_types,
        # layer_attention's scale is query_pre_attn_scalar ** -0.5
        query_pre_attn_scalar=None if scale is None else float(scale) ** -2,
        attn_logit_softcap=None if model.attn_soft_cap is None else float(model.attn_soft_cap),
    )
    config = ModelConfig(**fields)
    for i in range(model.num_layers):
        got, want = config.layer_attention(i), model.layer_attention(i)
        if (got.sliding_window, got.soft_cap) != (want.sliding_window, want.soft_cap) or not np.isclose(
                got.sm_scale, want.sm_scale, rtol=1e-12, atol=0):
            raise AssertionError(f"layer {i}: the engine would run {got}, the model declares {want}")
    return config


class CustomModelAdapter:
    """A CustomModel in the shape the runner calls (runner/step.py's `model=`):
    forward(params, config, input_ids, positions, kv_caches, attention, *, shards) and
    compute_logits(params, config, hidden), on the runner's params {PARAMS_KEY: user params}.
    The attention callback is checked as the user's forward calls it (at trace time only)."""

    def __init__(self, model: CustomModel, identity: str = ""):
        self.custom = model
        self.identity = identity

    def forward(self, params, config: ModelConfig, input_ids, positions, kv_caches, attention: AttentionFn, *,
                shards: int = 1):
        m = self.custom
        t = input_ids.shape[0]
        kv_caches = [None] * m.num_layers if kv_caches is None else list(kv_caches)
        if len(kv_caches) != m.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for a {m.num_layers}-layer model")

        def checked_attention(layer_idx, q, k, v, kv_cache):
            _check_attention_call(m, t, layer_idx, q, k, v)
            return attention(int(layer_idx), q, k, v, kv_cache)

        result = m.forward(params[PARAMS_KEY], input_ids, positions, kv_caches, checked_attention)
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError(f"{m.name}: forward must return (hidden [T, D], kv_caches), got {type(result).__name__}")
        hidden, new_caches = result
        if getattr(hidden, "ndim", None) != 2 or hidden.shape[0] != t:
            raise ValueError(f"{m.name}: forward returned hidden of shape {getattr(hidden, 'shape', None)} for "
                             f"{t} tokens; it must be [T, D] = [{t}, D]")
        new_caches = list(new_caches)
        if len(new_caches) != m.num_layers:
            raise ValueError(f"{m.name}: forward returned {len(new_caches)} KV caches for {m.num_layers} layers "
                             f"(keep every layer's, as its attention call returned it)")
        return hidden, new_caches

    def compute_logits(self, params, config: ModelConfig, hidden):
        m = self.custom
        logits = m.compute_logits(params[PARAMS_KEY], hidden)
        if getattr(logits, "shape", None) != (hidden.shape[0], m.vocab_size):
            raise ValueError(f"{m.name}: compute_logits returned shape {getattr(logits, 'shape', None)} for "
                             f"{hidden.shape[0]} rows; it must be [S, V] = [{hidden.shape[0]}, {m.vocab_size}]")
        return logits.astype(jnp.float32)


def _check_attention_call(m: CustomModel, t: int, layer_idx, q, k, v) -> None:
    if isinstance(layer_idx, jax.core.Tracer) or not isinstance(layer_idx, (int, np.integer)):
        raise TypeError(f"{m.name}: attention's layer index must be a Python int (loop over the layers in "
                        f"Python, not lax.scan), got {type(layer_idx).__name__}")
    if not 0 <= layer_idx < m.num_layers:
        raise ValueError(f"{m.name}: attention called for layer {layer_idx} of a {m.num_layers}-layer model")
    n, kh, h = m.num_heads, m.num_kv_heads, m.head_dim
    for name, x, heads in (("q", q, n), ("k", k, kh), ("v", v, kh)):
        if getattr(x, "shape", None) != (t, heads, h):
            raise ValueError(f"{m.name}: layer {layer_idx}'s attention got {name} of shape "
                             f"{getattr(x, 'shape', None)}; it must be [T, {'N' if name == 'q' else 'K'}, H] = "
                             f"[{t}, {heads}, {h}]")


def runner_params(params) -> dict:
    return {PARAMS_KEY: params}


def check_params(model: CustomModel, params) -> Any:
    """The user's params with every leaf an array (numpy leaves put on the default device);
    a clear error for a missing or non-array pytree."""
    if params is None:
        raise ValueError(f"LLM(model=CustomModel(...)) needs params=<the pytree {model.name}'s forward reads>")
    leaves, treedef = jax.tree.flatten(params)
    if not leaves:
        raise ValueError(f"params of {model.name} have no arrays (got {type(params).__name__})")
    bad = sorted({type(x).__name__ for x in leaves if not isinstance(x, (jax.Array, np.ndarray))})
    if bad:
        raise TypeError(f"params of {model.name} must be a pytree of jax.Arrays; it has leaves of type {bad}")
    return jax.tree.unflatten(treedef, [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves])


def check_model(model: CustomModel, params, *, tokens: int = 8) -> int:
    """Trace forward and compute_logits once (jax.eval_shape: nothing runs, nothing compiles)
    on a stand-in attention, so a model that breaks the protocol fails here with the reason
    rather than deep inside a compile. Returns the hidden size D."""
    adapter = CustomModelAdapter(model)

    def stand_in(layer_idx, q, k, v, kv_cache):
        return jnp.zeros_like(q), kv_cache

    def run(p, ids, pos):
        hidden, _ = adapter.forward(p, None, ids, pos, None, stand_in)
        return hidden, adapter.compute_logits(p, None, hidden[:2])

    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    try:
        hidden, _ = jax.eval_shape(run, runner_params(params), ids, ids)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{model.name} does not follow the CustomModel protocol: {e}") from e
    return int(hidden.shape[1])


def floating_dtype(params) -> str | None:
    """The floating dtype holding most of the params' elements (the KV arena's, by default)."""
    sizes: dict[str, int] = {}
    for x in jax.tree.leaves(params):
        if jnp.issubdtype(x.dtype, jnp.floating):
            sizes[str(x.dtype)] = sizes.get(str(x.dtype), 0) + int(np.prod(x.shape))
    return max(sizes, key=sizes.get) if sizes else None


# -- identity ---------------------------------------------------------------------------------

def model_identity(model: CustomModel, params) -> str:
    """sha256 over what a compiled step of this model depends on beyond jaxserve: the model's
    numbers, its params' structure, shapes and dtypes (not values), and the source of the code
    its forward and compute_logits run (see CustomModel). Editing that code changes it, so the
    executable cache never hands back a step traced from the code before the edit."""
    leaves, treedef = jax.tree.flatten(params)
    digest = hashlib.sha256()
    digest.update(json.dumps({"kind": "custom", "numbers": model.numbers(), "treedef": str(treedef),
                              "leaves": [[list(x.shape), str(x.dtype)] for x in leaves]},
                             sort_keys=True, default=repr).encode())
    for part in source_digests(model):
        digest.update(part.encode())
    return digest.hexdigest()


def source_digests(model: CustomModel) -> list[str]:
    files: set[str] = set()
    digests = []
    for fn in (model.forward, model.compute_logits):
        found = _defining_files(fn)
        if found is None:
            digests.append(_code_digest(fn, model.name))
        else:
            files |= found
    for mod in model.source_modules:
        name = mod.__name__ if isinstance(mod, types.ModuleType) else str(mod)
        found = _module_files(name)
        if not found:
            raise ValueError(f"CustomModel.source_modules: cannot find the source of {name!r}")
        files |= found
    for path in sorted(files):
        with open(path, "rb") as f:
            digests.append(path + ":" + hashlib.sha256(f.read()).hexdigest())
    return digests


def _unwrap(fn):
    while True:
        if isinstance(fn, types.MethodType):
            fn = fn.__func__
        elif isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__              # functools.wraps, jax.jit
        else:
            break
    if not (inspect.isfunction(fn) or inspect.isclass(fn)) and callable(fn):
        fn = type(fn)                        # a callable object (e.g. a module instance): its class
    return fn


def _defining_files(fn) -> set[str] | None:
    """The .py files whose code `fn` is: its module's file, or every file of the top-level
    package its module is in. None when it has no source file on disk (a notebook cell, a REPL)."""
    fn = _unwrap(fn)
    module = inspect.getmodule(fn)
    if module is None:
        return None
    name = module.__name__
    if name != "__main__" and "." in name:
        found = _module_files(name.split(".")[0])
        if found:
            return found
    path = getattr(module, "__file__", None)
    if path and path.endswith(".py") and os.path.exists(path):
        try:
            source = inspect.getsourcefile(fn)
        except TypeError:
            source = None
        if source is not None and os.path.abspath(source) == os.path.abspath(path):
            return {os.path.abspath(path)}
    return None


def _module_files(name: str) -> set[str]:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return set()
    if spec is None:
        return set()
    if spec.submodule_search_locations:
        files = set()
        for folder in spec.submodule_search_locations:
            for root, dirs, names in os.walk(folder):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                files |= {os.path.abspath(os.path.join(root, n)) for n in names if n.endswith(".py")}
        return files
    if spec.origin and spec.origin.endswith(".py") and os.path.exists(spec.origin):
        return {os.path.abspath(spec.origin)}
    return set()


def _code_digest(fn, name: str) -> str:
    """A function without a source file: its source as inspect sees it (IPython keeps cells), else
    its code object; with neither, an identity of this process alone (nothing is reused)."""
    fn = _unwrap(fn)
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()
    except (OSError, TypeError):
        pass
    code = getattr(fn, "__code__", None)
    if code is not None:
        return hashlib.sha256(marshal.dumps(code)).hexdigest()
    log.warning("%s: no source found for %r; its compiled steps will not be reused by a later start", name, fn)
    return uuid.uuid4().hex


def tensor_parallel_params(model: CustomModel, params, mesh, tensor_parallel_size: int):
    """The params placed on `mesh` as `model.partition_specs` says (tensor_parallel_size > 1, or a
    caller's mesh of one device, where no partition_specs are needed)."""
    from jax.sharding import NamedSharding

    n, k = model.num_heads, model.num_kv_heads
    if model.partition_specs is None and tensor_parallel_size == 1:
        # a caller's mesh of one device (LLM(mesh=...)): every leaf whole, on that device
        return jax.device_put(params, NamedSharding(mesh, jax.sharding.PartitionSpec()))
    if model.partition_specs is None:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} for a custom model needs "
                         f"CustomModel(partition_specs=params -> pytree of PartitionSpec over the axes "
                         f"('data', 'model')); tensor_parallel_size=1 needs none")
    if n % tensor_parallel_size or k % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide {model.name}'s num_heads={n} "
                         f"and num_kv_heads={k} (a custom model's KV heads are split, never replicated)")
    specs = model.partition_specs(params)
    try:
        shardings = jax.tree.map(lambda x, s: NamedSharding(mesh, s), params, specs)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{model.name}: partition_specs(params) must have the params' structure, with a "
                         f"PartitionSpec per array ({e})") from e
    return jax.device_put(params, shardings)

