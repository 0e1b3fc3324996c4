"""The compiled steps: one forward pass per shape bucket (runner/step.py), how each is lowered,
keyed in the executable cache and called (flat params, its arrays in one packed buffer).

A step returns the arena (donated, updated in place), the sampled rows' logits and the extra
outputs its features read (`outputs`, in order: "hidden" when a feature reads the rows' final
hidden states, "routed" for a mixture-of-experts model). Over a mesh the arena stays split on its
KV-head axis and everything else leaves replicated, for the sampler and the features.

With `sampler` (SamplerPrograms) each step is lowered with its logits rows' sampler fused in: one
launch per step instead of two, and the logits never leave the program; it then returns the
sampler's outputs where the logits were (flat_step.FusedStep). The engine fuses on an
accelerator (`fuse_sampler`'s default; on a CPU the sampler compiled into every bucket costs
more start-up than its launch saves), never where a draft model's outputs must reach the
sampler between the two (speculation with a draft model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.parallel.mesh import MODEL_AXIS
from jaxserve.parallel.sharding import arena_sharding, vocab_is_split
from jaxserve.runner.batch import batch_shapes, sample_rows_bucket
from jaxserve.runner.executables import ExecutableStore
from jaxserve.runner.flat_step import FlatStep, FusedStep, lower_flat
from jaxserve.runner.packed_inputs import InputLayout
from jaxserve.runner.programs import Programs
from jaxserve.runner.step import make_step


class StepPrograms:
    def __init__(self, programs: Programs, *, model_config, arena_spec, shapes, attention, model,
                 outputs: tuple[str, ...], expert_dispatch: str, batch_invariant: bool, prev_rows: int,
                 params_spec, sampler=None):
        """attention: the paged-attention function (runner/attention.py); model: what has the
        forward (None: the registry's); prev_rows: the previous step's padded sampled ids, which a
        step reads its placeholders from; params_spec: () -> the params the steps are lowered with;
        sampler: the SamplerPrograms to fuse into every step (None: the steps return logits)."""
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
        self.sampler = sampler
        self.store = ExecutableStore(shapes.buckets(), self._build, "step")

    def key(self, bucket: tuple[int, int]) -> dict:
        # a step that returns its hidden states is another program (an engine without prompt
        # logprobs or embeddings keeps the keys it always had)
        # flat: called with flat leaves (flat_step.py), another calling convention than entries
        # kept before it
        # packed: its arrays in one buffer (packed_inputs.py)
        return {"kind": "step", "bucket": bucket, "flat": True, "packed": True,
                **({"hidden": True} if "hidden" in self.outputs else {}),
                **({"fused_sampler": self.sampler.identity()} if self.sampler is not None else {})}

    @property
    def fused(self) -> bool:
        """Whether the steps sample too (one launch per step)."""
        return self.sampler is not None

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

        args = (layout.spec(self.programs.replicated), self.programs.input_spec((self.prev_rows,), jnp.int32))
        if self.sampler is not None:
            fn, args = self._with_sampler(fn, bucket, args)
        split = arena_sharding(mesh) if mesh is not None else None
        kv = self.arena_spec.shape_dtype(split)
        if mesh is None:
            return lower_flat(fn, (self.params_spec(), kv, *args), donate=1)
        # the arena stays split (donated in place); the logits (or sampled ids) and every extra
        # output leave replicated
        out_shardings = ([(split, split)] * self.arena_spec.num_layers, self.programs.replicated)
        out_shardings += (self.programs.replicated,) * len(self.outputs)
        return lower_flat(fn, (self.params_spec(), kv, *args), donate=1, out_shardings=out_shardings)

    def _with_sampler(self, step_fn, bucket: tuple[int, int], args: tuple):
        """The step followed by its logits rows' sampler, and the arguments that adds."""
        rows = sample_rows_bucket(*bucket)
        sample = self.sampler.traced(rows)

        placements = self._logits_placements()

        def fused(params, kv_caches, buffer, prev_tokens, sampler_buffer, sampler_rest):
            kv_caches, logits, *extra = step_fn(params, kv_caches, buffer, prev_tokens)
            for sharding in placements:
                logits = jax.lax.with_sharding_constraint(logits, sharding)
            return (kv_caches, sample(logits, sampler_buffer, sampler_rest, prev_tokens), *extra)

        layout = self.sampler.layout(rows)
        return fused, (*args, layout.spec(self.programs.replicated), self.sampler.rest_specs(rows))

    def _logits_placements(self) -> tuple:
        """Over a mesh, where a fused step's logits are pinned before it samples them: computed
        split by vocabulary (where the LM head is) and then replicated, one all-gather of [R, V]
        as when the step returned them. Pinned only replicated, XLA gathers the LM head's weight
        instead ([D, V] a step); left free, argmax and the sorts over a split row add collectives."""
        mesh = self.programs.mesh
        if mesh is None:
            return ()
        split = vocab_is_split(self.model_config.vocab_size, mesh.shape[MODEL_AXIS])
        return ((NamedSharding(mesh, P(None, MODEL_AXIS)),) if split else ()) + (self.programs.replicated,)

    def _build(self, bucket: tuple[int, int], reuse: bool = True):
        compiled = self.programs.load_or_compile(self.key(bucket), lambda: self._lower(bucket), reuse=reuse)
        if self.sampler is None:
            return FlatStep(compiled, self.layout(bucket))
        rows = sample_rows_bucket(*bucket)
        # the order lower_flat flattened the sampler's other arrays in: a dict's, by sorted key
        return FusedStep(compiled, self.layout(bucket), self.sampler.layout(rows),
                         tuple(sorted(self.sampler.rest_specs(rows))))

    def rebuild(self, bucket: tuple[int, int]) -> None:
        """Forget the cached executable of `bucket` and compile it again (ModelRunner.recompile)."""
        self.store.replace(bucket, self._build(bucket, reuse=False))
