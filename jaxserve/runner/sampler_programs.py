"""The compiled samplers: one per logits-row count, and what they read besides the logits.

A sampler's per-row options (temperature, top-k/p, seeds, banned ids...) arrive packed in one
int32 buffer (packed_inputs.py); the wide logit adjustments (penalty history, bias, grammar mask)
stay apart, and a step where no row adjusts reads neutral ones kept on the device, so such steps
(nearly all) copy nothing for them. A draft model's runner (`probs_out`) also returns each row's
distribution; a target coupled with a draft (`coupled_with_draft`) reads the draft's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.executables import ExecutableStore
from jaxserve.runner.packed_inputs import InputLayout, PackedSampler
from jaxserve.runner.programs import Programs
from jaxserve.runner.sampler import neutral_adjustment_arrays, sample, sampling_arrays


class SamplerPrograms:
    def __init__(self, programs: Programs, *, shapes: RunnerShapes, vocab_size: int, mask_words: int,
                 row_counts: list[int], probs_out: bool, coupled_with_draft: bool, logprobs_mode: str):
        self.programs = programs
        self.shapes = shapes
        self.vocab_size = vocab_size
        self.mask_words = mask_words
        self.pad_to = max(row_counts)          # the previous step's tokens, padded to the most rows
        self.probs_out = probs_out
        self.coupled_with_draft = coupled_with_draft
        self.logprobs_mode = logprobs_mode
        self.store = ExecutableStore(sorted(row_counts), self._build, "sampler")
        self._neutral: dict[int, dict] = {}    # logits rows -> neutral adjustment arrays on the device
        # what a coupled sampler reads in a step no draft model ran (an engine sharing this runner
        # without speculation): no row is coupled
        self._no_draft = (dict(probs=jnp.zeros((self.pad_to, vocab_size), jnp.float32),
                               padded_tokens=jnp.full((self.pad_to,), -1, jnp.int32))
                          if coupled_with_draft else None)

    def identity(self) -> dict:
        """What of the samplers' programs the executable cache's key must tell apart."""
        return {"probs_out": self.probs_out, "coupled_with_draft": self.coupled_with_draft,
                "logprobs_mode": self.logprobs_mode}

    def __call__(self, logits, sampling: dict, prev_tokens, draft_sample: dict | None = None) -> dict:
        """Sample a step's logits rows with their packed options (runner/persistent_batch.py)."""
        rows = logits.shape[0]
        return self.store[rows](logits, self.inputs(rows, sampling, draft_sample), prev_tokens)

    def inputs(self, rows: int, sampling: dict, draft_sample: dict | None = None) -> dict:
        """What a sampler of `rows` logits rows is called with besides the logits: the packed
        options, with the neutral adjustments where no row adjusts and a draft's outputs where
        coupled (a step with the sampler fused in takes the same, step_programs.py)."""
        if not (sampling["adjust"].any() or sampling["masked"].any()):
            sampling = {**sampling, **self.neutral_adjustments(rows)}
        if self.coupled_with_draft:
            draft = draft_sample or self._no_draft
            sampling = {**sampling, "draft_probs": draft["probs"], "draft_tokens": draft["padded_tokens"]}
        return sampling

    def neutral_adjustments(self, rows: int) -> dict:
        """The wide logit-adjustment arrays of a step where no row adjusts, on the device."""
        arrays = self._neutral.get(rows)
        if arrays is None:
            arrays = {k: self.programs.place(v) for k, v in
                      neutral_adjustment_arrays(rows, self.shapes.max_model_len, self.mask_words).items()}
            self._neutral[rows] = arrays
        return arrays

    def scratch(self) -> dict:
        """The device arrays the samplers made for themselves (made again when needed)."""
        return self._neutral

    def drop_scratch(self) -> None:
        self._neutral = {}

    def layout(self, rows: int) -> InputLayout:
        """The per-row options that travel in the packed buffer (the wide arrays go apart)."""
        base = sampling_arrays([None] * rows, rows, history_len=self.shapes.max_model_len, mask_words=self.mask_words)
        adjustments = neutral_adjustment_arrays(rows, self.shapes.max_model_len, self.mask_words)
        return InputLayout.of({k: (v.shape, v.dtype) for k, v in base.items() if k not in adjustments})

    def rest_specs(self, rows: int) -> dict:
        """Specs of the inputs a sampler of `rows` rows takes apart from its packed buffer."""
        spec = self.programs.input_spec
        specs = {k: spec(v.shape, v.dtype) for k, v in
                 sampling_arrays([None] * rows, rows, history_len=self.shapes.max_model_len,
                                 mask_words=self.mask_words).items()}
        if self.coupled_with_draft:
            specs["draft_probs"] = jax.ShapeDtypeStruct((self.pad_to, self.vocab_size), jnp.float32)
            specs["draft_tokens"] = jax.ShapeDtypeStruct((self.pad_to,), jnp.int32)
        names = self.layout(rows).names
        return {k: v for k, v in specs.items() if k not in names}

    def traced(self, rows: int):
        """The sampling function of `rows` rows as f(logits, buffer, rest, prev_tokens), to lower
        alone or inside a step."""
        layout = self.layout(rows)
        sampler = functools.partial(sample, pad_to=self.pad_to, probs_out=self.probs_out,
                                    logprobs_mode=self.logprobs_mode)

        def packed_sampler(logits, buffer, rest, prev_tokens):   # the per-row options in one buffer
            return sampler(logits, {**layout.unpack(buffer), **rest}, prev_tokens)

        return packed_sampler

    def _lower(self, rows: int):
        spec = self.programs.input_spec
        logits = spec((rows, self.vocab_size), jnp.float32)
        prev = spec((self.pad_to,), jnp.int32)
        return jax.jit(self.traced(rows)).lower(logits, self.layout(rows).spec(self.programs.replicated),
                                                self.rest_specs(rows), prev)

    def _build(self, rows: int, reuse: bool = True):
        # packed: its per-row options in one buffer (packed_inputs.py)
        compiled = self.programs.load_or_compile({"kind": "sampler", "rows": rows, "packed": True},
                                                 lambda: self._lower(rows), reuse=reuse)
        return PackedSampler(compiled, self.layout(rows))

    def rebuild(self, rows: int) -> None:
        """Forget the cached executable of `rows` and compile it again (ModelRunner.recompile)."""
        self.store.replace(rows, self._build(rows, reuse=False))
