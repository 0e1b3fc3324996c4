"""ModelRunner: the device side. Owns the weights, the KV arena and one compiled step per bucket.

It turns a SchedulerOutput into arrays (runner/batch.py), calls the bucket's compiled step with
the arena donated, and hands back the sampled tokens. It makes no scheduling decisions.

`dispatch` starts a step and returns at once (JAX dispatches asynchronously) with a `StepHandle`;
`collect` waits for that step's sampled tokens. Between the two the host is free: the engine's
one-step-ahead loop schedules and dispatches the next step there. The sampled ids also stay on the
device (`_prev_tokens`), where the next step reads the placeholders the scheduler left for them.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig
from jaxserve.runner import compile_counter
from jaxserve.runner.attention import select_attention
from jaxserve.runner.batch import batch_shapes, pack_step, sample_rows_bucket
from jaxserve.runner.buckets import RunnerShapes
from jaxserve.runner.sampler import sample, sampling_arrays
from jaxserve.runner.host_swap import HostSwapPool, SwapCostModel, measure_swap_cost
from jaxserve.runner.kv_arena import ArenaSpec, allocate_arena
from jaxserve.runner.step import make_step

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    # request id -> the tokens it sampled in the step, in order (one per step today; a
    # multi-token step, e.g. speculative decoding, fills more)
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepHandle:
    """A dispatched step; its outputs may still be computing on the device."""

    sample_rows: tuple[tuple[str, int], ...] = ()   # (request id, logits row) of requests that sample
    sampler_out: dict | None = None                  # the sampler's device arrays
    want_logprobs: np.ndarray | None = None          # per logits row


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params, arena: ArenaSpec, shapes: RunnerShapes,
                 attention_impl: str = "auto", xla_optimization_level: int | None = None,
                 num_host_blocks: int = 0):
        self.model_config = model_config
        self.params = params
        self.arena_spec = arena
        self.shapes = shapes
        self.kv_caches = allocate_arena(arena)
        self.host_pool = HostSwapPool(arena, num_host_blocks) if num_host_blocks else None
        self.swap_cost: SwapCostModel | None = None
        self._attention = select_attention(attention_impl)
        self._compiled: dict[tuple[int, int], object] = {}
        self._samplers: dict[int, object] = {}
        # the previous step's sampled ids, on the device, padded to the most logits rows any bucket has
        self.max_sample_rows = max(sample_rows_bucket(*b) for b in shapes.buckets())
        self._prev_tokens = jnp.zeros((self.max_sample_rows,), jnp.int32)
        self._prev_rows: dict[str, int] = {}   # request id -> its row in _prev_tokens
        self._prefill_tokens_per_s: float | None = None
        self._compiler_options = ({} if xla_optimization_level is None
                                  else {"xla_backend_optimization_level": xla_optimization_level})
        compile_counter.install()

    # -- compilation -------------------------------------------------------------------------
    def _lower(self, bucket: tuple[int, int]):
        D, P = bucket
        fn = make_step(self.model_config, self._attention, decode_rows=D, prefill_tiles=P,
                       tile=self.shapes.prefill_tile)
        specs = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in
                 batch_shapes(D, P, tile=self.shapes.prefill_tile, table_width=self.shapes.table_width).items()}
        kv = self.arena_spec.shape_dtype()
        prev = jax.ShapeDtypeStruct((self.max_sample_rows,), jnp.int32)
        return jax.jit(fn, donate_argnums=(1,)).lower(self.params, kv, specs, prev)

    def _lower_sampler(self, rows: int):
        logits = jax.ShapeDtypeStruct((rows, self.model_config.vocab_size), jnp.float32)
        specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in sampling_arrays([None] * rows, rows).items()}
        return jax.jit(functools.partial(sample, pad_to=self.max_sample_rows)).lower(logits, specs)

    def compile_all(self, progress: bool = True) -> None:
        """Compile every bucket (and the sampler for every row count) ahead of time, two at a time
        (XLA releases the GIL while compiling); nothing compiles while serving."""
        from concurrent.futures import ThreadPoolExecutor

        jobs = [("step", b) for b in self.shapes.buckets() if b not in self._compiled]
        rows = sorted({sample_rows_bucket(*b) for b in self.shapes.buckets()} - set(self._samplers))
        jobs += [("sampler", r) for r in rows]

        def build(job):
            kind, key = job
            lowered = self._lower(key) if kind == "step" else self._lower_sampler(key)
            return job, lowered.compile(compiler_options=self._compiler_options or None)

        with ThreadPoolExecutor(max_workers=2) as pool, _progress(progress, len(jobs), "compiling") as bar:
            for (kind, key), compiled in pool.map(build, jobs):
                (self._compiled if kind == "step" else self._samplers)[key] = compiled
                bar.update(1)
        self._warm_helpers()

    def _warm_helpers(self) -> None:
        # Host<->device transfers of each input dtype and the block copy used by copy-on-write
        # are compiled here too, so serving compiles nothing.
        self.copy_blocks([(0, 0)])
        if self.host_pool is not None:
            self.host_pool.swap_out(self.kv_caches, [(0, 0)])
            self.kv_caches = self.host_pool.swap_in(self.kv_caches, [(0, 0)])

    def warm_up(self, progress: bool = True) -> None:
        """Run every compiled bucket once, on scratch blocks (the arena is empty at start-up).
        The first execution of an XLA:CPU executable and its sampler costs 0.2-0.5 s more than
        the later ones (measured, embedded model: 8 decodes + one tile 563 ms, then 144 ms; an
        all-zero input removes only part of it), and while serving that would stall every
        request in the step that first needs a bucket: the step after the last long prompt
        finishes, the first step with 4 decodes, ... Start-up only: the scratch writes would
        overwrite blocks a live engine's requests and prefix cache hold."""
        tile = self.shapes.prefill_tile
        room = min(self.shapes.max_model_len - 1, (self.arena_spec.num_blocks - 1) * self.shapes.block_size)
        tiles_per_prompt = room // tile
        buckets = [b for b in sorted(self._compiled) if b[1] == 0 or tiles_per_prompt]
        with _progress(progress, len(buckets), "warming up") as bar:
            for D, P in buckets:
                requests = [self._scratch_request(f"warmup-{i}", 1, 0) for i in range(D)]
                left = P
                while left:
                    n = min(left, tiles_per_prompt)
                    requests.append(self._scratch_request(f"warmup-prompt-{left}", n * tile, 0))
                    left -= n
                self.execute(_scratch_step(requests))
                bar.update(1)

    # -- execution ---------------------------------------------------------------------------
    def execute(self, sched_out) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.collect(self.dispatch(sched_out))

    def dispatch(self, sched_out) -> StepHandle:
        """Start one step on the device and return without waiting for it. Placeholders in its
        token ids are read from the previous dispatched step's sampled tokens."""
        # Block operations first, in the scheduler's order: swap-outs may free blocks that
        # swap-ins and copies of the same step reuse.
        if sched_out.swap_out:
            self.host_pool.swap_out(self.kv_caches, sched_out.swap_out)
        if sched_out.swap_in:
            self.kv_caches = self.host_pool.swap_in(self.kv_caches, sched_out.swap_in)
        if sched_out.block_copies:
            self.copy_blocks(sched_out.block_copies)
        if not sched_out.requests:
            return StepHandle()
        packed = pack_step(sched_out, self.shapes, self._prev_rows)
        step = self._compiled.get(packed.bucket)
        if step is None:
            raise RuntimeError(f"bucket {packed.bucket} was not compiled at start-up")
        self.kv_caches, logits = step(self.params, self.kv_caches, packed.arrays, self._prev_tokens)
        self._prev_rows = dict(packed.sample_rows)
        if not packed.sample_rows:
            return StepHandle()
        out = self._samplers[logits.shape[0]](logits, packed.sampling)
        self._prev_tokens = out["padded_tokens"]
        wants = packed.sampling["want_logprobs"]
        # start the copies to the host now; collect() reads them a step later
        for key in ("tokens", "logprob", "top_ids", "top_logprobs") if wants.any() else ("tokens",):
            out[key].copy_to_host_async()
        return StepHandle(packed.sample_rows, out, wants)

    def is_ready(self, handle: StepHandle) -> bool:
        """Whether a dispatched step's sampled tokens are computed (collect would not wait)."""
        return not handle.sample_rows or handle.sampler_out["tokens"].is_ready()

    def collect(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a dispatched step's sampled tokens (and logprobs, where asked) on the host."""
        if not handle.sample_rows:
            return ModelRunnerOutput()
        out, wants = handle.sampler_out, handle.want_logprobs
        tokens = np.asarray(out["tokens"])
        lp = top_ids = top_lp = None
        if wants.any():
            lp, top_ids, top_lp = (np.asarray(out[k]) for k in ("logprob", "top_ids", "top_logprobs"))
        sampled = {}
        for request_id, row in handle.sample_rows:
            if wants[row]:
                sampled[request_id] = [SampledToken(
                    int(tokens[row]), float(lp[row]),
                    tuple(zip(top_ids[row].tolist(), top_lp[row].tolist())))]
            else:
                sampled[request_id] = [SampledToken(int(tokens[row]))]
        return ModelRunnerOutput(sampled)

    def measure_prefill_throughput(self, repeats: int = 2) -> float:
        """Prompt tokens per second of the largest prefill bucket, written into scratch blocks
        (the arena is empty at start-up). Measured once; later calls return the first result."""
        if self._prefill_tokens_per_s is None:
            n = min(self.shapes.prefill_buckets[-1] * self.shapes.prefill_tile, self.shapes.max_model_len - 1,
                    (self.arena_spec.num_blocks - 1) * self.shapes.block_size)
            step = _scratch_step([self._scratch_request("warmup", n, 0)])
            self._prefill_tokens_per_s = n / self._best_time(step, repeats)
        return self._prefill_tokens_per_s

    def _scratch_request(self, request_id: str, num_tokens: int, num_computed: int):
        """A greedy request of `num_tokens` new tokens after `num_computed` cached ones, on the
        scratch blocks 1, 2, ... (their contents do not matter for timing)."""
        from jaxserve.sched.scheduler_output import ScheduledRequest

        end = num_computed + num_tokens
        blocks = tuple(range(1, 1 + -(-end // self.shapes.block_size)))
        return ScheduledRequest(request_id, (0,) * num_tokens, num_computed, blocks, True, 0)

    def _decode_rows(self, context: int, rows: int | None = None) -> list:
        """A decode batch (default: a full one) at `context` tokens on shared scratch blocks."""
        rows = rows or self.shapes.max_decode_rows
        return [self._scratch_request(f"warmup-{i}", 1, context - 1) for i in range(rows)]

    def _best_time(self, out, repeats: int) -> float:
        self.execute(out)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            self.execute(out)
            best = min(best, time.perf_counter() - t)
        return best

    def measure_decode_step_time(self, context: int = 256, repeats: int = 2, rows: int | None = None) -> float:
        """Seconds of a decode-only step of `rows` decodes (default: the largest decode bucket),
        every row at `context` tokens. The rows share one block table of scratch blocks (the arena
        is empty at start-up), so this works however small the arena is."""
        bs = self.shapes.block_size
        context = max(1, min(context, self.shapes.max_model_len - 1, (self.arena_spec.num_blocks - 1) * bs))
        return self._best_time(_scratch_step(self._decode_rows(context, rows)), repeats)

    def measure_chunk_rate(self, chunk_tiles: int = 1, decode_context: int = 256, repeats: int = 2) -> float:
        """Prompt tokens per second that a chunk of `chunk_tiles` tiles adds to a full decode
        batch, the chunk at the deepest position a prompt reaches (max_model_len less the chunk):
        (chunk tokens) / (mixed step - decode-only step). A chunk's attention reads its whole
        context, so the deepest chunk is the costliest, and an ITL bound that is to hold for every
        chunk of a prompt (the p99, not the mean) must be sized by it. The largest-bucket prefill
        from an empty context (measure_prefill_throughput) overstates this rate several times."""
        capacity = (self.arena_spec.num_blocks - 1) * self.shapes.block_size
        chunk = min(chunk_tiles, self.shapes.prefill_buckets[-1]) * self.shapes.prefill_tile
        decode_context = max(1, min(decode_context, capacity, self.shapes.max_model_len - 1))
        depth = max(0, min(self.shapes.max_model_len - chunk, capacity - chunk))
        rows = self._decode_rows(decode_context)
        decode_only = self._best_time(_scratch_step(rows), repeats)
        mixed = self._best_time(_scratch_step(rows + [self._scratch_request("warmup-chunk", chunk, depth)]), repeats)
        return chunk / max(mixed - decode_only, 1e-6)

    def measure_swap_cost(self) -> SwapCostModel:
        """The cost model behind preemption_mode="auto": swap bandwidth and fixed cost against
        prefill throughput, measured on this machine at start-up."""
        tps = self.measure_prefill_throughput()
        self.swap_cost, self.kv_caches = measure_swap_cost(self.host_pool, self.kv_caches, tps,
                                                           self.shapes.block_size)
        log.info("swap cost model: %s; recompute is cheaper below %d tokens", self.swap_cost,
                 self.swap_cost.crossover_tokens())
        return self.swap_cost

    def copy_blocks(self, pairs) -> None:
        """Copy whole blocks (src -> dst) in every layer, COPY_BATCH pairs per compiled call;
        padding pairs copy the null block onto itself."""
        pairs = list(pairs)
        for i in range(0, len(pairs), COPY_BATCH):
            chunk = pairs[i:i + COPY_BATCH]
            chunk += [(0, 0)] * (COPY_BATCH - len(chunk))
            src = np.array([p[0] for p in chunk], np.int32)
            dst = np.array([p[1] for p in chunk], np.int32)
            self.kv_caches = _copy_blocks(self.kv_caches, src, dst)


COPY_BATCH = 16


def _progress(enabled: bool, total: int, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="shape", leave=False, disable=not enabled or not total)


def _scratch_step(requests):
    from jaxserve.sched.scheduler_output import SchedulerOutput

    return SchedulerOutput(tuple(requests), sum(len(r.token_ids) for r in requests))


def _copy_blocks_impl(kv_caches, src, dst):
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]


_copy_blocks = jax.jit(_copy_blocks_impl, donate_argnums=(0,))
