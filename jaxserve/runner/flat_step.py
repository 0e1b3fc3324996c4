"""A compiled step called with flat arguments: the params' leaves flattened once, not per call.

A compiled function taking `(params, kv_caches, arrays, prev_tokens)` flattens that pytree on
every call (in jax's C++ path, but per leaf: the embedded model's ~300 params leaves cost about
0.1 ms a call on our CPU, measured in docs/benchmarks.md "The host path"). The step is therefore
lowered as a function of the flat leaves, `lower_flat`, and `FlatStep` calls it with the params'
leaves the runner flattened once when its params were set (ModelRunner.params), the arena's few
leaves, and the packed arrays in a fixed key order. The program is the same: jit flattens its
arguments into the same HLO parameters either way; only the Python calling convention changes.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxserve.runner.packed_inputs import InputLayout


def lower_flat(fn: Callable, args: tuple, *, donate: int, **jit_kwargs):
    """jax.jit(fn).lower(*args) as a function of the flat leaves of `args`, argument `donate`
    (its leaves) donated."""
    leaves, tree = jax.tree.flatten(args)
    sizes = [len(jax.tree.leaves(a)) for a in args]
    first = sum(sizes[:donate])

    def flat(*xs):
        return fn(*jax.tree.unflatten(tree, xs))

    return jax.jit(flat, donate_argnums=tuple(range(first, first + sizes[donate])), **jit_kwargs).lower(*leaves)


class FlatStep:
    """A step compiled by `lower_flat` from (params, kv_caches, packed arrays, prev_tokens): its
    arrays dict arrives in one buffer laid out by `layout` (packed_inputs.py)."""

    __slots__ = ("compiled", "layout")

    def __init__(self, compiled, layout: InputLayout):
        self.compiled = compiled
        self.layout = layout

    def __call__(self, params, kv_caches, arrays: dict, prev_tokens, *, param_leaves: list | None = None):
        """The pytree convention; `param_leaves`: params already flattened (the step loop's)."""
        if param_leaves is None:
            param_leaves = jax.tree.leaves(params)
        return self.compiled(*param_leaves, *jax.tree.leaves(kv_caches), self.layout.pack(arrays), prev_tokens)

    def __getattr__(self, name):
        # as_text(), cost_analysis() and the like: the compiled executable's
        return getattr(self.compiled, name)


class FusedStep:
    """A step with its sampler fused in (step_programs.py, one launch per step), compiled by
    `lower_flat` from (params, kv_caches, step buffer, prev_tokens, sampler buffer, sampler's other
    arrays): returns (kv_caches, the sampler's outputs, the step's extra outputs...)."""

    __slots__ = ("compiled", "layout", "sampler_layout", "sampler_names", "_packed_names")

    def __init__(self, compiled, layout: InputLayout, sampler_layout: InputLayout,
                 sampler_names: tuple[str, ...]):
        self.compiled = compiled
        self.layout = layout
        self.sampler_layout = sampler_layout
        self.sampler_names = sampler_names     # the arrays apart from its buffer, in their flattened order
        self._packed_names = frozenset(sampler_layout.names)

    def __call__(self, params, kv_caches, arrays: dict, prev_tokens, sampling: dict, *,
                 param_leaves: list | None = None):
        if param_leaves is None:
            param_leaves = jax.tree.leaves(params)
        if len(sampling) != len(self._packed_names) + len(self.sampler_names):
            raise ValueError(f"a fused step's sampler takes {sorted(self._packed_names | set(self.sampler_names))}, "
                             f"got {sorted(sampling)}")
        return self.compiled(*param_leaves, *jax.tree.leaves(kv_caches), self.layout.pack(arrays), prev_tokens,
                             self.sampler_layout.pack(sampling), *(sampling[k] for k in self.sampler_names))

    def __getattr__(self, name):
        return getattr(self.compiled, name)
