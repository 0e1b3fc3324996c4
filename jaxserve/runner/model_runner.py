"""ModelRunner: the device side. Owns the weights, the KV arena and one compiled step per bucket.

It turns a SchedulerOutput into arrays (runner/batch.py), calls the bucket's compiled step with
the arena donated, and hands back the sampled tokens. It makes no scheduling decisions.

`dispatch` starts a step and returns at once (JAX dispatches asynchronously) with a `StepHandle`;
`collect` waits for that step's sampled tokens. Between the two the host is free: the engine's
one-step-ahead loop schedules and dispatches the next step there. The sampled ids also stay on the
device (`_prev_tokens`), where the next step reads the placeholders the scheduler left for them.

With a `mesh` (tensor parallelism: jaxserve/parallel/) the params arrive sharded, the arena is
allocated split on its KV-head axis, and every step and sampler is compiled for the mesh: the
step's packed inputs, its logits and the sampler's inputs and outputs replicated, so sampling
runs once, on whole logits. Without one every array lives on the default device, as before.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import build as cpu_kernel_build
from cpu_kernels.int8_dot import cpu_kernels as cpu_kernels_mode
from jaxserve.models.batch_invariant import batch_invariant as batch_invariant_mode
from jaxserve.models.config import ModelConfig
from jaxserve.runner import compile_counter
from jaxserve.runner.attention import select_attention
from jaxserve.runner.batch import batch_shapes, sample_rows_bucket
from jaxserve.runner.persistent_batch import PersistentBatch
from jaxserve.runner.flat_step import FlatStep, lower_flat
from jaxserve.runner.packed_inputs import InputLayout, PackedSampler
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.sampler import neutral_adjustment_arrays, sample, sampling_arrays
from jaxserve.runner.token_mask import mask_words
from jaxserve.runner import fingerprint
from jaxserve.runner.executables import ExecutableCache, ExecutableStore, compile_to_keep
from jaxserve.runner.host_swap import HostSwapPool, SwapCostModel
from jaxserve.runner.prompt_logprobs import PromptLogprobs
from jaxserve.runner.pooling import Pooling
from jaxserve.runner.kv_arena import ArenaSpec, allocate_arena
from jaxserve.parallel.mesh import describe as describe_mesh, replicated
from jaxserve.parallel.sharding import arena_sharding
from jaxserve.runner.step import make_step

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    # request id -> the token ids it sampled in the step, in order (one per step; a verification
    # of speculative guesses gives the guesses kept and one more)
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request id -> the same tokens with their logprobs, only for requests that asked for
    # logprobs (a SampledToken per token costs ~0.5 us: not made for the others)
    logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request id -> the prompt positions its rows in the step described (prompt_logprobs.PromptLogprobChunk)
    prompt_logprobs: dict = field(default_factory=dict)
    # request id -> the summed hidden states of its rows in the step (pooling.PooledChunk)
    pooled: dict = field(default_factory=dict)
    # a mixture-of-experts model: the step's routed tokens per (MoE layer, expert), [L_moe, E]
    routed_tokens: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class StepHandle:
    """A dispatched step; its outputs may still be computing on the device."""

    sample_rows: tuple[tuple[str, int], ...] = ()   # (request id, logits row) of requests that sample
    sampler_out: dict | None = None                  # the sampler's device arrays
    want_logprobs: np.ndarray | None = None          # per logits row
    drafts: dict[str, tuple[int, ...]] | None = None  # request id -> guesses it verifies (batch.PackedStep)
    prompt: tuple | None = None                      # prompt logprobs dispatched (PromptLogprobs.run)
    pooled: tuple | None = None                      # pooling dispatched (Pooling.run)
    routed: object = None                            # [L_moe, E] routed tokens (a MoE model's step)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One dispatched step as host data: its block operations and its packed arrays (None: the
    step only moves blocks). What a multi-host leader sends the other hosts (parallel/distributed.py)."""

    swap_out: tuple = ()
    swap_in: tuple = ()
    block_copies: tuple = ()
    packed: object = None                # batch.PackedStep
    prompt_rows: object = None           # prompt_logprobs.PromptRows: rows whose prompt logprobs are asked
    pooling_rows: object = None          # pooling.PoolingRows: rows whose hidden states an embedding pools
    kv_connector_ops: object = None      # sched KVConnectorOps: the KV connector's work (kv_connector_worker)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params, arena: ArenaSpec, shapes: RunnerShapes,
                 attention_impl: str = "auto", xla_optimization_level: int | None = None,
                 num_host_blocks: int = 0, executable_cache: ExecutableCache | None = None,
                 sampler_probs: bool = False, coupled_with_draft: bool = False, mesh=None, model=None,
                 prompt_logprobs: bool = False, logprobs_mode: str = "raw", pooling: bool = False,
                 expert_dispatch: str = "auto", batch_invariant: bool = False):
        """sampler_probs: the sampler also returns each row's distribution (a draft model's runner).
        coupled_with_draft: sampled rows are coupled with a draft model's rows of the same step
        (runner/sampler.py), which dispatch(draft_sample=...) hands over. model: what has the
        `forward` and `compute_logits` the steps run (default: the config's architecture in the
        model registry). prompt_logprobs: the steps also return their hidden states, and one more
        function per step row count computes prompt logprobs from them (runner/prompt_logprobs.py).
        logprobs_mode: what sampled tokens' logprobs describe, "raw" or "processed" (runner/sampler.py).
        pooling: the steps also return their hidden states (the same programs as for prompt
        logprobs), and one more function per step row count sums them for embeddings (runner/pooling.py).
        expert_dispatch: a mixture-of-experts model on a mesh with an "expert" axis: how its tokens
        reach their experts' devices (parallel/experts.py: auto, all_gather or all_to_all).
        batch_invariant: every program is traced in the batch-invariant mode (row-tiled matmuls
        and norms, models/batch_invariant.py; grouped attention, models/invariant_attention.py)."""
        if batch_invariant and (model_config.num_experts or model is not None):
            # the mode's tiling covers the registry's dense architectures (models/llama.py and
            # models/gemma.py); a router's top-k or a custom model's own ops are not tiled
            raise ValueError("batch_invariant=True runs the registry's dense architectures; "
                             + ("a mixture-of-experts model" if model_config.num_experts else "a custom model")
                             + " is not covered")
        self.model_config = model_config
        self.expert_dispatch = expert_dispatch
        self.batch_invariant = batch_invariant
        self.model = model
        self.params = params
        self.arena_spec = arena
        self.shapes = shapes
        self.mesh = mesh                 # None: one device; else tensor-parallel over its model axis
        self.step_mirror = None          # multi-host leader: publishes each step's inputs to the followers
        self.mesh_info = describe_mesh(mesh)
        self.kv_caches = self._allocate_arena()
        # set between sleep and wake_up (runner/sleep.py): kv_caches is None, params maybe abstract
        self.sleep_state = None
        self.host_pool = HostSwapPool(arena, num_host_blocks) if num_host_blocks else None
        self._copy_blocks = None   # compiled at the first copy (warm_helpers, at start-up)
        # the KV connector's runner side (sched/kv_connector.py KVConnectorWorker; None: no connector)
        self.kv_connector_worker = None
        self.swap_cost: SwapCostModel | None = None
        self.calibration: dict[str, object] | None = None  # start-up timings (runner/calibration.py)
        # (decode-only bucket, seconds): what speculation's extra rows cost, measured when it is on
        self.decode_step_seconds: tuple[tuple[int, float], ...] = ()
        self.attention_impl = attention_impl
        self._attention = select_attention(attention_impl)
        self._executable_cache = executable_cache
        # native CPU kernels (cpu_kernels/: w8a8's few-row dot) in the traced steps: one CPU device
        # only (a custom call would gather a mesh's sharded weights); built and registered here,
        # before any cached executable that calls them is loaded
        self.cpu_kernels = (mesh is None and self.execution_devices[0].platform == "cpu"
                            and cpu_kernel_build.registered())
        self._compiled = ExecutableStore(shapes.buckets(), self._build_step, "step")
        self._samplers = ExecutableStore(sorted({sample_rows_bucket(*b) for b in shapes.buckets()}),
                                         self._build_sampler, "sampler")
        # the previous step's sampled ids, on the device, padded to the most logits rows any bucket has
        self.max_sample_rows = max(sample_rows_bucket(*b) for b in shapes.buckets())
        self._prev_tokens = self._no_prev_tokens()
        self._prev_rows: dict[str, int] = {}   # request id -> its row in _prev_tokens
        self._neutral: dict[int, dict] = {}    # logits rows -> neutral adjustment arrays on the device
        self.sampler_probs = sampler_probs
        self.coupled_with_draft = coupled_with_draft
        self.logprobs_mode = logprobs_mode
        # what a coupled sampler reads in a step no draft model ran (an engine sharing this runner
        # without speculation): no row is coupled
        self._no_draft_sample = (dict(probs=jnp.zeros((self.max_sample_rows, model_config.vocab_size), jnp.float32),
                                      padded_tokens=jnp.full((self.max_sample_rows,), -1, jnp.int32))
                                 if coupled_with_draft else None)
        self.mask_words = mask_words(model_config.vocab_size)   # a structured-output token mask's width
        # per-request host state kept between steps (block tables, sampling values): a step packs
        # what changed since the last, not every request again (runner/persistent_batch.py)
        self._batch = PersistentBatch(shapes, mask_words=self.mask_words)
        self.compiler_options = ({} if xla_optimization_level is None
                                 else {"xla_backend_optimization_level": xla_optimization_level})
        # None: no prompt logprobs (the steps return only logits, as they always did)
        self.prompt_logprobs = PromptLogprobs(self) if prompt_logprobs else None
        self.pooling = Pooling(self) if pooling else None      # None: no embeddings
        compile_counter.install()

    # -- compilation -------------------------------------------------------------------------
    def _lower(self, bucket: tuple[int, int]):
        D, P = bucket
        fn = make_step(self.model_config, self._attention, decode_rows=D, prefill_tiles=P,
                       tile=self.shapes.prefill_tile, mesh=self.mesh, model=self.model,
                       return_hidden=self.returns_hidden, expert_dispatch=self.expert_dispatch,
                       block_size=self.arena_spec.block_size, batch_invariant=self.batch_invariant)
        layout = self._step_layout(bucket)
        step = fn

        def fn(params, kv_caches, buffer, prev_tokens):   # the step, its arrays arriving in one buffer
            return step(params, kv_caches, layout.unpack(buffer), prev_tokens)

        specs = layout.spec(None if self.mesh is None else replicated(self.mesh))
        prev = self._input((self.max_sample_rows,), jnp.int32)
        if self.mesh is None:
            kv = self.arena_spec.shape_dtype()
            return lower_flat(fn, (self.params, kv, specs, prev), donate=1)
        split = arena_sharding(self.mesh)
        kv = self.arena_spec.shape_dtype(split)
        # the arena stays split (donated in place); the logits leave replicated, for the sampler
        out_shardings = ([(split, split)] * self.arena_spec.num_layers, replicated(self.mesh))
        if self.returns_hidden:
            out_shardings += (replicated(self.mesh),)     # the hidden states, for prompt logprobs or pooling
        if self.counts_experts:
            out_shardings += (replicated(self.mesh),)     # the routed tokens per (MoE layer, expert)
        return lower_flat(fn, (self.params, kv, specs, prev), donate=1, out_shardings=out_shardings)

    def _input(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """A compiled function's host-packed input: on the device, or replicated over the mesh."""
        sharding = None if self.mesh is None else replicated(self.mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _on_device(self, array):
        """A host array put where the compiled functions read it (replicated over a mesh). A
        transfer, never a program: jnp.asarray of a host array runs jit(stage), compiled per shape
        and held in a bounded cache, so a shape whose entry an earlier engine's shapes pushed out
        compiled again while serving."""
        return jax.device_put(array, None if self.mesh is None else replicated(self.mesh))

    def _no_prev_tokens(self):
        return self._on_device(np.zeros((self.max_sample_rows,), np.int32))

    def _allocate_arena(self):
        return allocate_arena(self.arena_spec, sharding=None if self.mesh is None else arena_sharding(self.mesh))

    def _lower_sampler(self, rows: int):
        logits = self._input((rows, self.model_config.vocab_size), jnp.float32)
        specs = {k: self._input(v.shape, v.dtype) for k, v in
                 sampling_arrays([None] * rows, rows, history_len=self.shapes.max_model_len,
                                 mask_words=self.mask_words).items()}
        if self.coupled_with_draft:
            specs["draft_probs"] = jax.ShapeDtypeStruct((self.max_sample_rows, self.model_config.vocab_size),
                                                        jnp.float32)
            specs["draft_tokens"] = jax.ShapeDtypeStruct((self.max_sample_rows,), jnp.int32)
        prev = self._input((self.max_sample_rows,), jnp.int32)
        layout = self._sampler_layout(rows)
        sampler = functools.partial(sample, pad_to=self.max_sample_rows, probs_out=self.sampler_probs,
                                    logprobs_mode=self.logprobs_mode)

        def packed_sampler(logits, buffer, rest, prev_tokens):   # the per-row options in one buffer
            return sampler(logits, {**layout.unpack(buffer), **rest}, prev_tokens)

        rest = {k: v for k, v in specs.items() if k not in layout.names}
        return jax.jit(packed_sampler).lower(logits, layout.spec(None if self.mesh is None else replicated(self.mesh)),
                                             rest, prev)

    def _sampler_layout(self, rows: int) -> InputLayout:
        """The sampler's per-row options (temperature, top-k/p, seeds, banned ids...) packed in one
        buffer; the logit adjustments stay apart (device-resident neutral arrays in most steps)."""
        base = sampling_arrays([None] * rows, rows, history_len=self.shapes.max_model_len, mask_words=self.mask_words)
        adjustments = neutral_adjustment_arrays(rows, self.shapes.max_model_len, self.mask_words)
        return InputLayout.of({k: (v.shape, v.dtype) for k, v in base.items() if k not in adjustments})

    def _neutral_adjustments(self, rows: int) -> dict:
        """The wide logit-adjustment arrays of a step where no row adjusts, kept on the device so
        such steps (nearly all) copy nothing for them."""
        arrays = self._neutral.get(rows)
        if arrays is None:
            arrays = {k: self._on_device(v) for k, v in
                      neutral_adjustment_arrays(rows, self.shapes.max_model_len, self.mask_words).items()}
            self._neutral[rows] = arrays
        return arrays

    def load_executables(self, buckets=None, *, progress: bool = False, on_loaded=None) -> float:
        """Load (from the executable cache, or by compiling) the steps of `buckets` (default: every
        bucket) and their samplers; `on_loaded(bucket, step)` is called as each step arrives
        (warm-up runs it while the next one loads). Returns the seconds spent."""
        buckets = sorted(self.shapes.buckets() if buckets is None else set(buckets))
        seconds = self._samplers.load(sorted({sample_rows_bucket(*b) for b in buckets}))
        with progress_bar(progress, len(buckets), "loading steps") as bar:
            def loaded(bucket, step):
                bar.update(1)
                if on_loaded is not None:
                    on_loaded(bucket, step)
            seconds += self._compiled.load(buckets, on_loaded=loaded)
        if self.prompt_logprobs is not None:
            seconds += self.prompt_logprobs.load(buckets)
        if self.pooling is not None:
            seconds += self.pooling.load(buckets)
        return seconds

    def executables_loaded_on_demand(self) -> list:
        """Steps and samplers a run needed before they were loaded: each one cost that run a stall."""
        extra = self.prompt_logprobs._compiled.loaded_on_demand if self.prompt_logprobs is not None else []
        extra = extra + (self.pooling._compiled.loaded_on_demand if self.pooling is not None else [])
        return self._compiled.loaded_on_demand + self._samplers.loaded_on_demand + extra

    def step_and_sampler(self, bucket: tuple[int, int]) -> tuple:
        """The loaded step of `bucket` and the sampler of its logits rows, for a warm-up that runs
        them outside the engine's arena (runner/background_warmup.py); loaded here if not yet."""
        return self._compiled[bucket], self._samplers[sample_rows_bucket(*bucket)]

    def _step_key(self, bucket: tuple[int, int]) -> dict:
        # a step that returns its hidden states is another program (an engine without prompt
        # logprobs or embeddings keeps the keys it always had)
        # flat: called with flat leaves (flat_step.py), another calling convention than entries
        # kept before it
        # packed: its arrays in one buffer (packed_inputs.py)
        return {"kind": "step", "bucket": bucket, "flat": True, "packed": True,
                **({"hidden": True} if self.returns_hidden else {})}

    @property
    def counts_experts(self) -> bool:
        """A mixture-of-experts model's steps also return their routed tokens per (layer, expert)."""
        return bool(getattr(self.model_config, "moe_layers", ()))

    @property
    def returns_hidden(self) -> bool:
        """Whether the steps also return every row's final hidden state: prompt logprobs and
        embeddings read them (one program for both)."""
        return self.prompt_logprobs is not None or getattr(self, "pooling", None) is not None

    def _step_layout(self, bucket: tuple[int, int]) -> InputLayout:
        return InputLayout.of(batch_shapes(*bucket, tile=self.shapes.prefill_tile, table_width=self.shapes.table_width))

    def _build_step(self, bucket: tuple[int, int], reuse: bool = True):
        compiled = self._load_or_compile(self._step_key(bucket), lambda: self._lower(bucket), reuse=reuse)
        return FlatStep(compiled, self._step_layout(bucket))

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, params) -> None:
        # every writer (weight updates, sleep, LoRA slot writes) goes through here, so the
        # leaves the steps are called with are never stale
        self._params = params
        self._param_leaves = None

    def _flat_params(self) -> list:
        if self._param_leaves is None:
            self._param_leaves = jax.tree.leaves(self._params)
        return self._param_leaves

    def _build_sampler(self, rows: int, reuse: bool = True):
        # packed: its per-row options in one buffer (packed_inputs.py)
        compiled = self._load_or_compile({"kind": "sampler", "rows": rows, "packed": True},
                                         lambda: self._lower_sampler(rows), reuse=reuse)
        return PackedSampler(compiled, self._sampler_layout(rows))

    def recompile(self, bucket: tuple[int, int]) -> None:
        """A step (or its sampler) from the executable cache failed its first run: forget both
        entries, compile them here, and start from a fresh arena (the failed run may have consumed
        the donated one; only start-up warm-up calls this, when the arena holds nothing)."""
        rows = sample_rows_bucket(*bucket)
        self._compiled.replace(bucket, self._build_step(bucket, reuse=False))
        self._samplers.replace(rows, self._build_sampler(rows, reuse=False))
        self.kv_caches = self._allocate_arena()
        self._prev_tokens = self._no_prev_tokens()
        self._prev_rows = {}

    def _load_or_compile(self, what: dict, lower, reuse: bool = True):
        traced = lower

        def lower():
            # the mode is read while tracing (models/batch_invariant.py): steps, samplers, prompt
            # logprobs and pooling all trace inside it
            with batch_invariant_mode(self.batch_invariant), cpu_kernels_mode(self.cpu_kernels):
                return traced()

        cache = self._executable_cache
        if cache is None:
            return lower().compile(compiler_options=self.compiler_options or None)
        key = cache.key({**what, **self._program_inputs})
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
        """The devices the steps and samplers run on, in their device assignment's order: the
        mesh's (flattened, as jit assigns them), else the default device."""
        if self.mesh is not None:
            return list(self.mesh.devices.flat)
        default = jax.config.jax_default_device
        return [default if isinstance(default, jax.Device) else jax.devices()[0]]

    @functools.cached_property
    def _program_inputs(self) -> dict:
        """Everything that determines a step's or sampler's program (executables.py), but its kind."""
        # a model handed over from outside jaxserve (models/custom.py) has an identity: its own
        # code (which traced_source() does not cover) and its params' structure, shapes and dtypes;
        # its params are listed leaf by leaf (any pytree), with the placement its partition_specs chose
        identity = getattr(self.model, "identity", None)
        inputs = {
            "model": self.model_config, "arena": self.arena_spec, "shapes": self.shapes,
            "params": (jax.tree.map(lambda x: [list(x.shape), str(x.dtype)], self.params) if not identity else
                       [[list(x.shape), str(x.dtype), repr(getattr(x.sharding, "spec", None))]
                        for x in jax.tree.leaves(self.params)]),
            "attention_impl": self.attention_impl, "compiler_options": self.compiler_options,
            "expert_dispatch": self.expert_dispatch,
            **({"batch_invariant": True} if self.batch_invariant else {}),
            **({"cpu_kernels": True} if self.cpu_kernels else {}),
            # a 2-way executable must never serve a 4-way engine, nor one compiled for other devices
            "mesh": None if self.mesh is None else {**self.mesh_info.as_dict(),
                                                    "device_ids": self.mesh.device_ids.tolist()},
            "sampler": {"probs_out": self.sampler_probs, "coupled_with_draft": self.coupled_with_draft,
                        "logprobs_mode": self.logprobs_mode},
            "source": fingerprint.traced_source(), "software": fingerprint.software(),
            "machine": fingerprint.machine(),
        }
        if identity:
            inputs["model_identity"] = identity
        return inputs

    def warm_helpers(self) -> None:
        """Compile the block copy used by copy-on-write and the swap transfers (jitted helpers, not
        per bucket), so serving compiles nothing."""
        self.copy_blocks([(0, 0)])
        if self.host_pool is not None:
            self.host_pool.swap_out(self.kv_caches, [(0, 0)])
            self.kv_caches = self.host_pool.swap_in(self.kv_caches, [(0, 0)])

    # -- execution ---------------------------------------------------------------------------
    def execute(self, sched_out) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.collect(self.dispatch(sched_out))

    def dispatch(self, sched_out, draft_sample: dict | None = None) -> StepHandle:
        """Start one step on the device and return without waiting for it. Placeholders in its
        token ids are read from the previous dispatched step's sampled tokens. draft_sample: a draft
        model's sampler outputs for the same step (`StepHandle.sampler_out`), when coupled."""
        inputs = StepInputs(tuple(sched_out.swap_out), tuple(sched_out.swap_in), tuple(sched_out.block_copies),
                            self._batch.pack(sched_out, self._prev_rows)
                            if sched_out.requests else None,
                            kv_connector_ops=getattr(sched_out, "kv_connector_ops", None))
        if self.prompt_logprobs is not None and inputs.packed is not None:
            inputs = dataclasses.replace(inputs, prompt_rows=self.prompt_logprobs.pack(sched_out, inputs.packed.bucket))
        if self.pooling is not None and inputs.packed is not None:
            inputs = dataclasses.replace(inputs, pooling_rows=self.pooling.pack(sched_out, inputs.packed.bucket))
        if self.step_mirror is not None:
            # multi-host: every other host runs this step's programs too (parallel/distributed.py)
            # (the KV connector's work is this host's alone: its buffers never travel)
            self.step_mirror.publish(dataclasses.replace(inputs, kv_connector_ops=None))
        return self.run_inputs(inputs, draft_sample)

    def run_inputs(self, inputs: "StepInputs", draft_sample: dict | None = None) -> StepHandle:
        """The device half of `dispatch`: a step's block operations, forward pass and sampling from
        its packed inputs (what a multi-host follower receives and runs)."""
        # Block operations first, in the scheduler's order: swap-outs may free blocks that
        # swap-ins and copies of the same step reuse.
        if self.host_pool is not None:
            self.host_pool.flush()     # the last step's saves: their gathers ran before it
        if inputs.swap_out:
            self.host_pool.swap_out(self.kv_caches, inputs.swap_out)
        if inputs.swap_in:
            self.kv_caches = self.host_pool.swap_in(self.kv_caches, inputs.swap_in)
        if inputs.kv_connector_ops and self.kv_connector_worker is not None:
            self.kv_connector_worker.apply(inputs.kv_connector_ops)   # writes or reads self.kv_caches
        if inputs.block_copies:
            self.copy_blocks(inputs.block_copies)
        packed = inputs.packed
        if packed is None:
            return StepHandle()
        step = self._compiled.get(packed.bucket)
        if step is None:
            raise RuntimeError(f"bucket {packed.bucket} was not compiled at start-up")
        self.kv_caches, logits, *extra = step(self._params, self.kv_caches, packed.arrays, self._prev_tokens,
                                              param_leaves=self._flat_params())
        hidden = extra[:1] if self.returns_hidden else []
        routed = extra[-1] if self.counts_experts else None
        if routed is not None:
            routed.copy_to_host_async()
        # prompt logprobs only in a step that carries rows asking for them (hidden: with the option on)
        prompt = self.prompt_logprobs.run(hidden[0], inputs.prompt_rows) if inputs.prompt_rows is not None else None
        pooled = self.pooling.run(hidden[0], inputs.pooling_rows) if inputs.pooling_rows is not None else None
        # a verification's last token is known only at collect(): no later step may read it as a
        # placeholder (the scheduler schedules after its update), so it has no row here
        self._prev_rows = (dict(packed.sample_rows) if not packed.drafts else
                           {rid: row for rid, row in packed.sample_rows if rid not in packed.drafts})
        if not packed.sample_rows:
            return StepHandle(prompt=prompt, pooled=pooled, routed=routed)
        sampling = packed.sampling
        if not (sampling["adjust"].any() or sampling["masked"].any()):
            sampling = {**sampling, **self._neutral_adjustments(logits.shape[0])}
        if self.coupled_with_draft:
            draft = draft_sample or self._no_draft_sample
            sampling = {**sampling, "draft_probs": draft["probs"], "draft_tokens": draft["padded_tokens"]}
        out = self._samplers[logits.shape[0]](logits, sampling, self._prev_tokens)
        self._prev_tokens = out["padded_tokens"]
        wants = packed.sampling["want_logprobs"]
        # start the copies to the host now; collect() reads them a step later
        for key in ("tokens", "logprob", "top_ids", "top_logprobs") if wants.any() else ("tokens",):
            out[key].copy_to_host_async()
        return StepHandle(packed.sample_rows, out, wants, packed.drafts, prompt, pooled, routed)

    def is_ready(self, handle: StepHandle) -> bool:
        """Whether a dispatched step's sampled tokens are computed (collect would not wait)."""
        return not handle.sample_rows or handle.sampler_out["tokens"].is_ready()

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a dispatched step's sampled tokens (and logprobs, where asked) on the host."""
        prompt = PromptLogprobs.read(handle.prompt) if handle.prompt is not None else {}
        pooled = Pooling.read(handle.pooled) if handle.pooled is not None else {}
        routed = np.asarray(handle.routed) if handle.routed is not None else None
        if not handle.sample_rows:
            return ModelRunnerOutput(prompt_logprobs=prompt, pooled=pooled, routed_tokens=routed)
        out, wants = handle.sampler_out, handle.want_logprobs
        # Python ints once for the whole step (indexing a numpy array per row costs more)
        tokens = np.asarray(out["tokens"]).tolist()
        drafts = handle.drafts or {}
        any_logprobs = bool(wants.any())
        if not drafts and not any_logprobs:
            # the common step: one plain token per request
            return ModelRunnerOutput({rid: [tokens[row]] for rid, row in handle.sample_rows}, {},
                                     prompt, pooled, routed)
        lp = top_ids = top_lp = None
        if any_logprobs:
            lp, top_ids, top_lp = (np.asarray(out[k]) for k in ("logprob", "top_ids", "top_logprobs"))
        token_ids, logprobs = {}, {}
        for request_id, row in handle.sample_rows:
            guesses = drafts.get(request_id, ())
            # row j sampled the token after guess j - 1: guess j is kept while it equals the token
            # row j sampled, so each kept token is exactly what one-token steps would have sampled
            kept = 0
            while kept < len(guesses) and tokens[row + kept] == guesses[kept]:
                kept += 1
            token_ids[request_id] = tokens[row:row + kept + 1]
            if any_logprobs and wants[row]:
                logprobs[request_id] = [
                    SampledToken(tokens[r], float(lp[r]), tuple(zip(top_ids[r].tolist(), top_lp[r].tolist())))
                    for r in range(row, row + kept + 1)]
        return ModelRunnerOutput(token_ids, logprobs, prompt, pooled, routed)

    def copy_blocks(self, pairs) -> None:
        """Copy whole blocks (src -> dst) in every layer, COPY_BATCH pairs per compiled call;
        padding pairs copy the null block onto itself."""
        pairs = list(pairs)
        for i in range(0, len(pairs), COPY_BATCH):
            chunk = pairs[i:i + COPY_BATCH]
            chunk += [(0, 0)] * (COPY_BATCH - len(chunk))
            src = np.array([p[0] for p in chunk], np.int32)
            dst = np.array([p[1] for p in chunk], np.int32)
            if self._copy_blocks is None:   # compiled ahead and held, as the swap's (host_swap.py says why)
                self._copy_blocks = jax.jit(_copy_blocks_impl, donate_argnums=(0,)).lower(
                    self.kv_caches, src, dst).compile()
            self.kv_caches = self._copy_blocks(self.kv_caches, src, dst)


COPY_BATCH = 16


def progress_bar(enabled: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="shape", leave=False, disable=not enabled or not total)


def _copy_blocks_impl(kv_caches, src, dst):
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]

