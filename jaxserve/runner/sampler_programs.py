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
        if not (sampling["adjust"].any() or sampling["masked"].any()):
            sampling = {**sampling, **self.neutral_adjustments(logits.shape[0])}
        if self.coupled_with_draft:
            draft = draft_sample or self._no_draft
            sampling = {**sampling, "draft_probs": draft["probs"], "draft_tokens": draft["padded_tokens"]}
        return self.store[logits.shape[0]](logits, sampling, prev_tokens)

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

    def _layout(self, rows: int) -> InputLayout:
        base = sampling_arrays([None] * rows, rows, history_len=self.shapes.max_model_len, mask_words=self.mask_words)
        adjustments = neutral_adjustment_arrays(rows, self.shapes.max_model_len, self.mask_words)
        return InputLayout.of({k: (v.shape, v.dtype) for k, v in base.items() if k not in adjustments})

    def _lower(self, rows: int):
        spec = self.programs.input_spec
        logits = spec((rows, self.vocab_size), jnp.float32)
        specs = {k: spec(v.shape, v.dtype) for k, v in
                 sampling_arrays([None] * rows, rows, history_len=self.shapes.max_model_len,
                                 mask_words=self.mask_words).items()}
        if self.coupled_with_draft:
            specs["draft_probs"] = jax.ShapeDtypeStruct((self.pad_to, self.vocab_size), jnp.float32)
            specs["draft_tokens"] = jax.ShapeDtypeStruct((self.pad_to,), jnp.int32)
        prev = spec((self.pad_to,), jnp.int32)
        layout = self._layout(rows)
        sampler = functools.partial(sample, pad_to=self.pad_to, probs_out=self.probs_out,
                                    logprobs_mode=self.logprobs_mode)

        def packed_sampler(logits, buffer, rest, prev_tokens):   # the per-row options in one buffer
            return sampler(logits, {**layout.unpack(buffer), **rest}, prev_tokens)

        rest = {k: v for k, v in specs.items() if k not in layout.names}
        return jax.jit(packed_sampler).lower(logits, layout.spec(self.programs.replicated), rest, prev)

    def _build(self, rows: int, reuse: bool = True):
        # packed: its per-row options in one buffer (packed_inputs.py)
        compiled = self.programs.load_or_compile({"kind": "sampler", "rows": rows, "packed": True},
                                                 lambda: self._lower(rows), reuse=reuse)
        return PackedSampler(compiled, self._layout(rows))

    def rebuild(self, rows: int) -> None:
        """Forget the cached executable of `rows` and compile it again (ModelRunner.recompile)."""
        self.store.replace(rows, self._build(rows, reuse=False))
