"""The LoRA slots on the device: created empty beside the base weights, written one slot at a time.

Each projection's `lora_a` / `lora_b` (lora/slot_layout.py) sit in the params beside its weight,
so every compiled step takes them as inputs, and the program is the same whichever adapters they
hold. Loading an adapter into a slot is one call of a function compiled at start-up (`warm`),
which writes the slot's block of every projection's arrays, the old arrays donated: an update in
place, never a compilation while serving. The host values come from the registry
(lora/registry.py); the slot index is an argument, so one program serves every slot.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.lora.slot_layout import LORA_A, LORA_B, empty_slots
from jaxserve.lora.targets import LoRATargets
from jaxserve.models.tensor_layout import Path


def with_empty_slots(params: dict, targets: LoRATargets, max_loras: int, max_rank: int, mesh=None) -> dict:
    """params with zero LoRA slot arrays beside every projection's weight, in the model's dtype;
    with a mesh, split with their projections (parallel/sharding.py)."""
    dtype = params["embed_tokens"]["embedding"].dtype
    for path, arrays in empty_slots(targets, max_loras, max_rank, np.float32).items():
        module = _module(params, path)
        for leaf, host in arrays.items():
            module[leaf] = jax.device_put(host.astype(dtype), _sharding(mesh, targets, path, leaf, host.shape))
    return params


def _sharding(mesh, targets: LoRATargets, path: Path, leaf: str, shape) -> NamedSharding | None:
    if mesh is None:
        return None
    from jaxserve.models.tensor_layout import Projection
    from jaxserve.parallel.sharding import param_spec

    module = targets.modules[path]
    spec = Projection(module.parts, module.in_features, module.parallel)
    return NamedSharding(mesh, param_spec(spec, leaf, tuple(shape), vocab_split=False))


def _module(params: dict, path: Path) -> dict:
    node = params
    for key in path:
        node = node[key]
    return node


def _write(slots: dict, slot: jax.Array, values: dict) -> dict:
    # slot is 1-based (0 is the base model, which has no arrays)
    out = {}
    for name, (a, b) in slots.items():
        va, vb = values[name]
        out[name] = (a.at[:, slot - 1].set(va.astype(a.dtype)), b.at[slot - 1].set(vb.astype(b.dtype)))
    return out


class DeviceLoRASlots:
    """What each slot holds on the device, and the compiled writer."""

    def __init__(self, targets: LoRATargets, max_loras: int, mesh=None) -> None:
        self.paths = list(targets.modules)
        self.max_loras = max_loras
        self.mesh = mesh           # tensor parallelism: the slots stay split as the steps read them
        self.resident: dict[int, str] = {}      # slot -> adapter key written there
        self._writer = None
        self._compiling = threading.Lock()      # the background warm-up may compile it beside a write

    def _tree(self, params: dict) -> dict:
        return {"/".join(p): (_module(params, p)[LORA_A], _module(params, p)[LORA_B]) for p in self.paths}

    def warm(self, params: dict) -> dict:
        """Compile the writer (start-up, or the background warm-up's helpers), from the arrays'
        shapes only: nothing is written, so a step another thread runs meanwhile keeps its inputs.
        Once: a second call (a write that came first) finds it compiled."""
        with self._compiling:
            if self._writer is None:
                self._writer = self._compile(params)
        return params

    @property
    def compiled(self) -> bool:
        return self._writer is not None

    def _compile(self, params: dict):
        tree = self._tree(params)
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        # the host values arrive whole (replicated over a mesh); the slots keep their shardings
        whole = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        values = {name: (jax.ShapeDtypeStruct(a.shape[:1] + a.shape[2:], np.float32, sharding=whole),
                         jax.ShapeDtypeStruct(b.shape[1:], np.float32, sharding=whole))
                  for name, (a, b) in tree.items()}
        slot = jax.ShapeDtypeStruct((), np.int32, sharding=whole)
        out_shardings = jax.tree.map(lambda x: x.sharding, tree)
        return jax.jit(_write, donate_argnums=(0,), out_shardings=out_shardings).lower(shapes, slot, values).compile()

    def write(self, params: dict, slot: int, key: str, values: dict[Path, tuple[np.ndarray, np.ndarray]]) -> dict:
        """params with `values` (one slot's host arrays per projection) in `slot`."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.max_loras}")
        if self._writer is None:   # the background warm-up has not reached it: compile it here and wait
            self.warm(params)
        named = {"/".join(p): v for p, v in values.items()}
        params = self._put(params, self._writer(self._tree(params), np.int32(slot), named))
        self.resident[slot] = key
        return params

    def _put(self, params: dict, tree: dict) -> dict:
        for path in self.paths:
            a, b = tree["/".join(path)]
            module = _module(params, path)
            module[LORA_A], module[LORA_B] = a, b
        return params
