"""The compiled steps: one forward pass per shape bucket (runner/step.py), how each is lowered,
keyed in the executable cache and called (flat params, its arrays in one packed buffer).

A step returns the arena (donated, updated in place), the sampled rows' logits and the extra
outputs its features read (`outputs`, in order: "hidden" when a feature reads the rows' final
hidden states, "routed" for a mixture-of-experts model). Over a mesh the arena stays split on its
KV-head axis and everything else leaves replicated, for the sampler and the features.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.parallel.sharding import arena_sharding
from jaxserve.runner.batch import batch_shapes
from jaxserve.runner.executables import ExecutableStore
from jaxserve.runner.flat_step import FlatStep, lower_flat
from jaxserve.runner.packed_inputs import InputLayout
from jaxserve.runner.programs import Programs
from jaxserve.runner.step import make_step


class StepPrograms:
    def __init__(self, programs: Programs, *, model_config, arena_spec, shapes, attention, model,
                 outputs: tuple[str, ...], expert_dispatch: str, batch_invariant: bool, prev_rows: int,
                 params_spec):
        """attention: the paged-attention function (runner/attention.py); model: what has the
        forward (None: the registry's); prev_rows: the previous step's padded sampled ids, which a
        step reads its placeholders from; params_spec: () -> the params the steps are lowered with."""
        self.programs = programs
        self.model_config = model_config
        self.arena_spec = arena_spec
        self.shapes = shapes
        self.attention = attention
        self.model = model
        self.outputs = outputs
        self.expert_dispatch = expert_dispatch
        self.batch_invariant = batch_invariant
        self.prev_rows = prev_rows
        self.params_spec = params_spec
        self.store = ExecutableStore(shapes.buckets(), self._build, "step")

    def key(self, bucket: tuple[int, int]) -> dict:
        # a step that returns its hidden states is another program (an engine without prompt
        # logprobs or embeddings keeps the keys it always had)
        # flat: called with flat leaves (flat_step.py), another calling convention than entries
        # kept before it
        # packed: its arrays in one buffer (packed_inputs.py)
        return {"kind": "step", "bucket": bucket, "flat": True, "packed": True,
                **({"hidden": True} if "hidden" in self.outputs else {})}

    def layout(self, bucket: tuple[int, int]) -> InputLayout:
        return InputLayout.of(batch_shapes(*bucket, tile=self.shapes.prefill_tile, table_width=self.shapes.table_width))

    def _lower(self, bucket: tuple[int, int]):
        D, P = bucket
        mesh = self.programs.mesh
        step = make_step(self.model_config, self.attention, decode_rows=D, prefill_tiles=P,
                         tile=self.shapes.prefill_tile, mesh=mesh, model=self.model,
                         return_hidden="hidden" in self.outputs, expert_dispatch=self.expert_dispatch,
                         block_size=self.arena_spec.block_size, batch_invariant=self.batch_invariant)
        layout = self.layout(bucket)

        def fn(params, kv_caches, buffer, prev_tokens):   # the step, its arrays arriving in one buffer
            return step(params, kv_caches, layout.unpack(buffer), prev_tokens)

        specs = layout.spec(self.programs.replicated)
        prev = self.programs.input_spec((self.prev_rows,), jnp.int32)
        if mesh is None:
            return lower_flat(fn, (self.params_spec(), self.arena_spec.shape_dtype(), specs, prev), donate=1)
        split = arena_sharding(mesh)
        kv = self.arena_spec.shape_dtype(split)
        # the arena stays split (donated in place); the logits and every extra output leave replicated
        out_shardings = ([(split, split)] * self.arena_spec.num_layers, self.programs.replicated)
        out_shardings += (self.programs.replicated,) * len(self.outputs)
        return lower_flat(fn, (self.params_spec(), kv, specs, prev), donate=1, out_shardings=out_shardings)

    def _build(self, bucket: tuple[int, int], reuse: bool = True):
        compiled = self.programs.load_or_compile(self.key(bucket), lambda: self._lower(bucket), reuse=reuse)
        return FlatStep(compiled, self.layout(bucket))

    def rebuild(self, bucket: tuple[int, int]) -> None:
        """Forget the cached executable of `bucket` and compile it again (ModelRunner.recompile)."""
        self.store.replace(bucket, self._build(bucket, reuse=False))
