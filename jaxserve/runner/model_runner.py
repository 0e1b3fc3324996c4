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

import logging
import threading
from collections.abc import Sequence

import jax
import numpy as np

from cpu_kernels import build as cpu_kernel_build
from jaxserve.models.config import ModelConfig
from jaxserve.parallel.mesh import describe as describe_mesh
from jaxserve.parallel.sharding import arena_sharding
from jaxserve.runner import compile_counter
from jaxserve.runner.attention import select_attention
from jaxserve.runner.batch import sample_rows_bucket
from jaxserve.runner.block_copy import BlockCopy
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.executables import ExecutableCache
from jaxserve.runner.host_swap import HostSwapPool, measure_swap_seconds
from jaxserve.runner.kv_arena import ArenaSpec, allocate_arena
from jaxserve.runner.kv_connector_ops import KVConnectorOps
from jaxserve.runner.persistent_batch import PersistentBatch
from jaxserve.runner.programs import Programs, execution_devices, program_identity
from jaxserve.runner.sampled_tokens import SampledToken, read_sampled
from jaxserve.runner.sampler_programs import SamplerPrograms
from jaxserve.runner.sleep import RunnerSleep
from jaxserve.runner.step_data import ModelRunnerOutput, StepHandle, StepInputs
from jaxserve.runner.step_feature import StepFeature
from jaxserve.runner.step_programs import StepPrograms
from jaxserve.runner.token_mask import mask_words

log = logging.getLogger(__name__)

__all__ = ["ModelRunner", "ModelRunnerOutput", "SampledToken", "StepHandle", "StepInputs"]


class ModelRunner(RunnerSleep):
    def __init__(self, model_config: ModelConfig, params, arena: ArenaSpec, shapes: RunnerShapes,
                 attention_impl: str = "auto", xla_optimization_level: int | None = None,
                 num_host_blocks: int = 0, executable_cache: ExecutableCache | None = None,
                 sampler_probs: bool = False, coupled_with_draft: bool = False, mesh=None, model=None,
                 logprobs_mode: str = "raw", features: Sequence[StepFeature] = (),
                 expert_dispatch: str = "auto", batch_invariant: bool = False, fuse_sampler: bool = False):
        """sampler_probs: the sampler also returns each row's distribution (a draft model's runner).
        coupled_with_draft: sampled rows are coupled with a draft model's rows of the same step
        (runner/sampler.py), which dispatch(draft_sample=...) hands over. model: what has the
        `forward` and `compute_logits` the steps run (default: the config's architecture in the
        model registry). logprobs_mode: what sampled tokens' logprobs describe, "raw" or
        "processed" (runner/sampler.py). features: the step features the steps carry
        (runner/step_feature.py: prompt logprobs, pooling, expert counts, ...), in the order they
        run. expert_dispatch: a mixture-of-experts model on a mesh with an "expert" axis: how its
        tokens reach their experts' devices (parallel/experts.py: auto, all_gather or all_to_all).
        fuse_sampler: each step samples too, one launch per step (runner/step_programs.py), unless
        a draft model's outputs must reach the sampler between them.
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
        # held off the step thread while a program runs on params (background warm-up), and by a
        # writer that donates them (LoRA slot writes): the writer waits instead of deleting them
        self.params_lock = threading.RLock()
        self.arena_spec = arena
        self.shapes = shapes
        self.mesh = mesh                 # None: one device; else tensor-parallel over its model axis
        self._step_mirror = None         # multi-host leader: publishes each step's inputs to the followers
        self.owner = None                # the engine whose block ids the arena follows (engine.py sets it)
        self.mesh_info = describe_mesh(mesh)
        self.kv_caches = self.allocate_arena()
        # set between sleep and wake_up (runner/sleep.py RunnerSleep): kv_caches is None, params maybe abstract
        self.sleep_state = None
        self.host_pool = HostSwapPool(arena, num_host_blocks) if num_host_blocks else None
        self._block_copy = BlockCopy()   # compiled at the first copy (warm_helpers, at start-up)
        # start-up timings measured on this runner (runner/calibration.py), by name: kept here so
        # a later engine on the same runner (LLM.sharing_runner, bench variants) measures nothing twice
        self.measurements: dict[str, object] = {}
        self.attention_impl = attention_impl
        # native CPU kernels (cpu_kernels/: w8a8's few-row dot) in the traced steps: one CPU device
        # only (a custom call would gather a mesh's sharded weights); built and registered here,
        # before any cached executable that calls them is loaded
        on_cpu = mesh is None and execution_devices(None)[0].platform == "cpu"
        self.cpu_kernels = on_cpu and cpu_kernel_build.registered()
        self.compiler_options = ({} if xla_optimization_level is None
                                 else {"xla_backend_optimization_level": xla_optimization_level})
        self.programs = Programs(mesh=mesh, executable_cache=executable_cache,
                                 compiler_options=self.compiler_options, batch_invariant=batch_invariant,
                                 cpu_kernels=self.cpu_kernels, identity=self.program_identity)
        self.features: tuple[StepFeature, ...] = tuple(features)
        # the compiled steps' extra outputs, in the order the step returns them (runner/step.py)
        self._step_outputs = ((("hidden",) if self.returns_hidden else ())
                              + (("routed",) if self.counts_experts else ()))
        self.mask_words = mask_words(model_config.vocab_size)   # a structured-output token mask's width
        self.sampler = SamplerPrograms(self.programs, shapes=shapes, vocab_size=model_config.vocab_size,
                                       mask_words=self.mask_words,
                                       row_counts=sorted({sample_rows_bucket(*b) for b in shapes.buckets()}),
                                       probs_out=sampler_probs, coupled_with_draft=coupled_with_draft,
                                       logprobs_mode=logprobs_mode)
        # the previous step's sampled ids, on the device, padded to the most logits rows any bucket has
        self.max_sample_rows = self.sampler.pad_to
        self.step_programs = StepPrograms(self.programs, model_config=model_config, arena_spec=arena, shapes=shapes,
                                          attention=select_attention(attention_impl), model=model,
                                          outputs=self._step_outputs, expert_dispatch=expert_dispatch,
                                          batch_invariant=batch_invariant, prev_rows=self.max_sample_rows,
                                          params_spec=lambda: self.params,
                                          sampler=None if fuse_sampler is False or sampler_probs
                                          or coupled_with_draft else self.sampler)
        self.steps = self.step_programs.store    # bucket -> its compiled step (FlatStep)
        self._prev_tokens = self._no_prev_tokens()
        self._prev_rows: dict[str, int] = {}   # request id -> its row in _prev_tokens
        # per-request host state kept between steps (block tables, sampling values): a step packs
        # what changed since the last, not every request again (runner/persistent_batch.py)
        self._batch = PersistentBatch(shapes, mask_words=self.mask_words)
        for feature in self.features:
            feature.attach(self)
        compile_counter.install()

    # -- features and what they read -----------------------------------------------------------
    def add_feature(self, feature: StepFeature) -> None:
        """A feature attached after the steps were built (the KV connector's ops, LoRA slot
        writes): it may read no step output the steps were not compiled with."""
        missing = feature.step_outputs - set(self._step_outputs)
        if missing:
            raise ValueError(f"step feature {feature.name!r} reads step outputs {sorted(missing)} "
                             "the steps were compiled without; hand it to the runner at construction")
        feature.attach(self)
        self.features += (feature,)

    def attach_kv_connector(self, worker) -> None:
        """The KV connector's runner side (sched/kv_connector.py KVConnectorWorker): it applies each
        step's loads and saves before the step's forward pass."""
        self.add_feature(KVConnectorOps(worker))

    def mirror_steps_to(self, mirror) -> None:
        """Multi-host leader: every dispatched step's inputs are published to the followers
        (parallel/distributed.py Hosts.publish) before they run here (None: no longer)."""
        self._step_mirror = mirror

    @property
    def step_mirror(self):     # where this runner publishes its steps (a leader's Hosts), or None
        return self._step_mirror

    @property
    def logprobs_mode(self) -> str:
        return self.sampler.logprobs_mode

    @property
    def model_functions(self):
        """What has the `forward` and `compute_logits` the steps run (the registry's row if no
        model was handed in)."""
        if self.model is not None:
            return self.model
        from jaxserve.models import registry

        return registry.for_config(self.model_config).model()

    @property
    def counts_experts(self) -> bool:
        """A mixture-of-experts model's steps also return their routed tokens per (layer, expert)."""
        return bool(getattr(self.model_config, "moe_layers", ()))

    @property
    def returns_hidden(self) -> bool:
        """Whether the steps also return every row's final hidden state (a feature reads them)."""
        return any("hidden" in f.step_outputs for f in self.features)

    # -- compilation -------------------------------------------------------------------------
    def _no_prev_tokens(self):
        return self.programs.place(np.zeros((self.max_sample_rows,), np.int32))

    def allocate_arena(self):
        """A fresh, zeroed KV arena in this runner's placement (start-up, wake-up, a recompile)."""
        return allocate_arena(self.arena_spec, sharding=None if self.mesh is None else arena_sharding(self.mesh))

    def scratch_arrays(self) -> dict:
        """Device arrays the runner made for itself and makes again when needed (the samplers'
        neutral adjustments): what a sleep frees besides the arena and the weights."""
        return self.sampler.scratch()

    def forget_step_state(self) -> None:
        """Drop the scratch arrays and the previous step's rows: no placeholder of a later step
        may point into a step from before (a sleep)."""
        self.sampler.drop_scratch()
        self._prev_rows = {}

    def load_executables(self, buckets=None, *, progress: bool = False, on_loaded=None) -> float:
        """Load (from the executable cache, or by compiling) the steps of `buckets` (default: every
        bucket), their samplers and the features' programs; `on_loaded(bucket, step)` is called
        as each step arrives (warm-up runs it while the next one loads). Returns the seconds spent."""
        buckets = sorted(self.shapes.buckets() if buckets is None else set(buckets))
        seconds = (0.0 if self.step_programs.fused
                   else self.sampler.store.load(sorted({sample_rows_bucket(*b) for b in buckets})))
        with progress_bar(progress, len(buckets), "loading steps") as bar:
            def loaded(bucket, step):
                bar.update(1)
                if on_loaded is not None:
                    on_loaded(bucket, step)
            seconds += self.steps.load(buckets, on_loaded=loaded)
        for feature in self.features:
            seconds += feature.load(buckets)
        return seconds

    def restrict_buckets(self, warm: frozenset[tuple[int, int]] | None) -> None:
        """Steps run only in these buckets (the cheapest that holds each, padded) while the rest
        still warm (runner/warm_plan.py); None: in the smallest that holds each, as compiled."""
        self._batch.warm = warm

    def executables_loaded_on_demand(self) -> list:
        """Programs a run needed before they were loaded: each one cost that run a stall."""
        extra = [key for feature in self.features for key in feature.loaded_on_demand()]
        return self.steps.loaded_on_demand + self.sampler.store.loaded_on_demand + extra

    def step_and_sampler(self, bucket: tuple[int, int]) -> tuple:
        """The loaded step of `bucket` and the sampler of its logits rows (None: fused into the
        step), for a warm-up that runs them outside the engine's arena (runner/background_warmup.py);
        loaded here if not yet."""
        if self.step_programs.fused:
            return self.steps[bucket], None
        return self.steps[bucket], self.sampler.store[sample_rows_bucket(*bucket)]

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

    def recompile(self, bucket: tuple[int, int]) -> None:
        """A step (or its sampler) from the executable cache failed its first run: forget both
        entries, compile them here, and start from a fresh arena (the failed run may have consumed
        the donated one; only start-up warm-up calls this, when the arena holds nothing)."""
        self.step_programs.rebuild(bucket)
        if not self.step_programs.fused:
            self.sampler.rebuild(sample_rows_bucket(*bucket))
        self.kv_caches = self.allocate_arena()
        self._prev_tokens = self._no_prev_tokens()
        self._prev_rows = {}

    @property
    def execution_devices(self) -> list:      # the devices the programs run on (runner/programs.py)
        return self.programs.execution_devices

    def program_identity(self) -> dict:
        """Everything that determines a step's or sampler's program (executables.py), but its kind."""
        return program_identity(self)

    def warm_helpers(self) -> None:
        """Compile the block copy used by copy-on-write and the swap transfers (jitted helpers, not
        per bucket), so serving compiles nothing."""
        self.copy_blocks([(0, 0)])
        if self.host_pool is not None:
            self.host_pool.swap_out(self.kv_caches, [(0, 0)])
            self.kv_caches = self.host_pool.swap_in(self.kv_caches, [(0, 0)])

    def transform_arena(self, program) -> None:
        """Replace the arena by program(arena): a compiled write outside the steps (a KV load's
        scatter, runner/kv_transfer.py), run in order after every step dispatched before it."""
        self.kv_caches = program(self.kv_caches)

    def time_swaps(self) -> tuple[float, float]:
        """(fixed, per block) seconds of a swap out and back in (host_swap.measure_swap_seconds),
        measured on the arena's scratch blocks: what calibration's swap cost model is built from."""
        fixed_s, per_block_s, self.kv_caches = measure_swap_seconds(self.host_pool, self.kv_caches)
        return fixed_s, per_block_s

    # -- execution ---------------------------------------------------------------------------
    def execute(self, sched_out) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.collect(self.dispatch(sched_out))

    def dispatch(self, sched_out, draft_sample: dict | None = None) -> StepHandle:
        """Start one step on the device and return without waiting for it. Placeholders in its
        token ids are read from the previous dispatched step's sampled tokens. draft_sample: a draft
        model's sampler outputs for the same step (`StepHandle.sampler_out`), when coupled."""
        packed = self._batch.pack(sched_out, self._prev_rows) if sched_out.requests else None
        bucket = packed.bucket if packed is not None else None
        rows = {}
        for feature in self.features:
            got = feature.pack(sched_out, bucket)
            if got is not None:
                rows[feature.name] = got
        inputs = StepInputs(tuple(sched_out.swap_out), tuple(sched_out.swap_in), tuple(sched_out.block_copies),
                            packed, rows)
        if self._step_mirror is not None:
            # multi-host: every other host runs this step's programs too (parallel/distributed.py),
            # less the features whose work is this host's alone (the KV connector's buffers)
            local = {f.name for f in self.features if not f.mirrored}
            self._step_mirror.publish(StepInputs(inputs.swap_out, inputs.swap_in, inputs.block_copies, packed,
                                                 {k: v for k, v in rows.items() if k not in local}))
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
        features = [(f, inputs.features.get(f.name)) for f in self.features]
        for feature, rows in features:
            if rows is not None:
                feature.before_step(rows)
        if inputs.block_copies:
            self.copy_blocks(inputs.block_copies)
        packed = inputs.packed
        if packed is None:
            return StepHandle()
        step = self.steps.get(packed.bucket)
        if step is None:
            raise RuntimeError(f"bucket {packed.bucket} was not compiled at start-up")
        fused = self.step_programs.fused
        if fused:        # one launch: the step samples its logits rows itself
            sampling = self.sampler.inputs(sample_rows_bucket(*packed.bucket), packed.sampling)
            self.kv_caches, out, *extra = step(self._params, self.kv_caches, packed.arrays, self._prev_tokens,
                                               sampling, param_leaves=self._flat_params())
        else:
            self.kv_caches, logits, *extra = step(self._params, self.kv_caches, packed.arrays, self._prev_tokens,
                                                  param_leaves=self._flat_params())
        outputs = dict(zip(self._step_outputs, extra))
        dispatched = {}
        for feature, rows in features:
            if rows is not None or feature.runs_every_step:
                dispatched[feature.name] = feature.run(outputs, rows)
        # a verification's last token is known only at collect(): no later step may read it as a
        # placeholder (the scheduler schedules after its update), so it has no row here
        self._prev_rows = (dict(packed.sample_rows) if not packed.drafts else
                           {rid: row for rid, row in packed.sample_rows if rid not in packed.drafts})
        if not packed.sample_rows:       # a fused step's sampled ids are padding then: dropped
            return StepHandle(features=dispatched)
        if not fused:
            out = self.sampler(logits, packed.sampling, self._prev_tokens, draft_sample)
        self._prev_tokens = out["padded_tokens"]
        wants = packed.sampling["want_logprobs"]
        # start the copies to the host now; collect() reads them a step later
        for key in ("tokens", "logprob", "top_ids", "top_logprobs") if wants.any() else ("tokens",):
            out[key].copy_to_host_async()
        return StepHandle(packed.sample_rows, out, wants, packed.drafts, dispatched)

    def is_ready(self, handle: StepHandle) -> bool:
        """Whether a dispatched step's sampled tokens are computed (collect would not wait)."""
        return not handle.sample_rows or handle.sampler_out["tokens"].is_ready()

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a dispatched step's sampled tokens (and logprobs, where asked) on the host."""
        features = ({f.name: f.read(handle.features[f.name]) for f in self.features if f.name in handle.features}
                    if handle.features else {})
        if not handle.sample_rows:
            return ModelRunnerOutput(features=features)
        token_ids, logprobs = read_sampled(handle.sampler_out, handle.sample_rows, handle.want_logprobs,
                                           handle.drafts)
        return ModelRunnerOutput(token_ids, logprobs, features)

    def copy_blocks(self, pairs) -> None:
        """Copy whole blocks (src -> dst) in every layer (copy-on-write, runner/block_copy.py)."""
        self.kv_caches = self._block_copy(self.kv_caches, pairs)


def progress_bar(enabled: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="shape", leave=False, disable=not enabled or not total)
