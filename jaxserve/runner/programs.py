"""Where the runner's compiled programs come from and where their inputs live.

Every program the runner calls (the steps, the samplers, and what its step features add:
runner/step_feature.py) is placed the same way and comes through the same executable cache, so
both are one public object the runner and its features share instead of the runner's private
helpers:

- placement: a host array put where the programs read it (`place`), and the abstract input a
  program is lowered with (`input_spec`): on the default device, or replicated over the mesh;
- `load_or_compile`: an executable from the cache keyed by what determines the program
  (`identity()`, the runner's model, arena, shapes, mesh, software and machine, plus the
  program's own kind and shape), else traced in the runner's trace-time modes and compiled.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import jax

from cpu_kernels.int8_dot import cpu_kernels as cpu_kernels_mode
from jaxserve.models.batch_invariant import batch_invariant as batch_invariant_mode
from jaxserve.parallel.mesh import replicated
from jaxserve.runner import fingerprint
from jaxserve.runner.executables import ExecutableCache, compile_to_keep

log = logging.getLogger(__name__)


class Programs:
    def __init__(self, *, mesh, executable_cache: ExecutableCache | None, compiler_options: dict,
                 batch_invariant: bool, cpu_kernels: bool, identity: Callable[[], dict]):
        """identity: everything that determines a program but its kind and shape (read once, at
        the first cache look-up: ModelRunner.program_identity)."""
        self.mesh = mesh
        self.executable_cache = executable_cache
        self.compiler_options = compiler_options
        self.batch_invariant = batch_invariant
        self.cpu_kernels = cpu_kernels
        self._identity = identity

    @functools.cached_property
    def identity(self) -> dict:
        return self._identity()

    # -- placement ------------------------------------------------------------------------------
    @property
    def replicated(self):
        """The sharding of a host-packed input or a whole output: None on one device."""
        return None if self.mesh is None else replicated(self.mesh)

    def input_spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """A compiled function's host-packed input: on the device, or replicated over the mesh."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    def place(self, array):
        """A host array put where the compiled functions read it (replicated over a mesh). A
        transfer, never a program: jnp.asarray of a host array runs jit(stage), compiled per shape
        and held in a bounded cache, so a shape whose entry an earlier engine's shapes pushed out
        compiled again while serving."""
        return jax.device_put(array, self.replicated)

    def jit(self, fn, **kwargs):
        """jax.jit with every output replicated over the mesh (a feature's small results)."""
        if self.mesh is not None:
            kwargs.setdefault("out_shardings", self.replicated)
        return jax.jit(fn, **kwargs)

    # -- executables ----------------------------------------------------------------------------
    def load_or_compile(self, what: dict, lower: Callable, reuse: bool = True):
        """The executable of `lower()` (a jax Lowered), from the cache under `what` + identity or
        compiled (and kept). reuse=False: forget the cached entry and compile it again."""
        traced = lower

        def lower():
            # the modes are read while tracing (models/batch_invariant.py, cpu_kernels/): steps,
            # samplers and every feature's programs all trace inside them
            with batch_invariant_mode(self.batch_invariant), cpu_kernels_mode(self.cpu_kernels):
                return traced()

        cache = self.executable_cache
        if cache is None:
            # nothing is kept, and nothing goes to XLA's persistent cache either (compile_to_keep
            # does not write it): a process that set its folder (the setting is process-wide)
            # would otherwise fill it with programs jaxserve never reads back from there
            return compile_to_keep(lower(), self.compiler_options)[0]
        key = cache.key({**what, **self.identity})
        if not reuse:
            cache.forget(key)
        compiled = cache.load(key, self.execution_devices) if reuse else None
        if compiled is None:
            compiled, keepable = compile_to_keep(lower(), self.compiler_options)
            if keepable:
                cache.store(key, compiled)
            else:
                log.info("%s %s came from XLA's compilation cache, whose executables cannot be kept; "
                         "it will be traced again next start", what["kind"], what)
        return compiled

    @property
    def execution_devices(self) -> list:
        """The devices the programs run on, in their device assignment's order: the mesh's
        (flattened, as jit assigns them), else the default device."""
        return execution_devices(self.mesh)


def execution_devices(mesh) -> list:
    """The devices a runner's programs run on: the mesh's, flattened as jit assigns them, else the
    default device (jax_default_device when set, e.g. the CPU on a GPU machine)."""
    if mesh is not None:
        return list(mesh.devices.flat)
    default = jax.config.jax_default_device
    return [default if isinstance(default, jax.Device) else jax.devices()[0]]


def program_identity(runner) -> dict:
    """Everything that determines one of `runner`'s programs (executables.py), but its kind and
    shape: its model, arena, shapes, params' structure, modes, mesh, samplers, source, software and
    machine."""
    # a model handed over from outside jaxserve (models/custom.py) has an identity: its own
    # code (which traced_source() does not cover) and its params' structure, shapes and dtypes;
    # its params are listed leaf by leaf (any pytree), with the placement its partition_specs chose
    identity = getattr(runner.model, "identity", None)
    inputs = {
        "model": runner.model_config, "arena": runner.arena_spec, "shapes": runner.shapes,
        "params": (jax.tree.map(lambda x: [list(x.shape), str(x.dtype)], runner.params) if not identity else
                   [[list(x.shape), str(x.dtype), repr(getattr(x.sharding, "spec", None))]
                    for x in jax.tree.leaves(runner.params)]),
        "attention_impl": runner.attention_impl, "compiler_options": runner.compiler_options,
        "expert_dispatch": runner.expert_dispatch,
        **({"batch_invariant": True} if runner.batch_invariant else {}),
        **({"cpu_kernels": True} if runner.cpu_kernels else {}),
        # a 2-way executable must never serve a 4-way engine, nor one compiled for other devices
        "mesh": None if runner.mesh is None else {**runner.mesh_info.as_dict(),
                                                "device_ids": runner.mesh.device_ids.tolist()},
        "sampler": runner.sampler.identity(),
        "source": fingerprint.traced_source(), "software": fingerprint.software(),
        "machine": fingerprint.machine(),
    }
    if identity:
        inputs["model_identity"] = identity
    return inputs
