"""Warming the buckets a ready engine does not need yet, in a thread beside the step loop.

warm_up="background" (warm_plan.py): the engine turns ready once the plan's first buckets are
warm; this thread loads (or compiles) and runs once every other bucket, in the plan's order, marking
each ready in a `BucketReadiness`, which widens the buckets steps may run in and the step cap. The
step thread never waits for it and never meets a bucket it has not finished.

Its first runs must not touch what the step thread owns: the arena is donated to every step
(a run from this thread would consume the engine's), and the runner's previous-step tokens feed
the next step's placeholders. So they run on a scratch arena of the same shape, allocated here
and dropped when the last bucket is warm, with zero previous tokens, through the same loaded
executables the engine will call (a first run is paid once per loaded executable, whatever the
buffers). On the CPU that arena is host memory the size of the KV cache, held only for the
warm-up. On other platforms, where a loaded executable's first run costs nothing extra, the
buckets are only loaded. A first run reads the runner's weights under `runner.params_lock`,
which a writer that donates them (a LoRA slot write, lora/slot_writes.py) takes too: that writer
waits for the run in progress instead of deleting the arrays it reads.

Before the buckets the thread builds the engine's helpers it was started with (`start(helpers)`:
the grammar compiler's tokenizer, the LoRA slot writer): seconds, against the buckets' minutes, so
the first request that needs one finds it built (or waits for the build in progress).

Compilations here (a cold start) are counted in this thread's own counter (`compilations`), never
in the engine's `num_compilations_after_warmup`, which counts the serving path: a step, a block
copy or a swap that compiled would still be counted there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxserve.runner import compile_counter
from jaxserve.runner.batch import sample_rows_bucket
from jaxserve.runner.persistent_batch import PersistentBatch
from jaxserve.runner.kv_arena import allocate_arena
from jaxserve.runner.warm_plan import BucketReadiness
from jaxserve.runner.warmup import warm_up_step

log = logging.getLogger(__name__)


def before_bucket(bucket: tuple[int, int]) -> None:
    """Called in the warm-up thread before each bucket; tests replace it to hold the warm-up at a
    point they choose (an Event they set), never to time it."""


class BackgroundWarmUp:
    def __init__(self, runner, readiness: BucketReadiness, *, first_runs: bool | None = None,
                 busy: Callable[[], bool] = lambda: False, idle_poll_s: float = 0.2):
        """first_runs: run each bucket once after loading it (default: on the CPU, where a loaded
        executable's first run builds its fusions' runtime pipelines: warmup.py). busy: whether
        requests are live; the plan's `when_idle` buckets wait for it to be False (polled)."""
        self.runner = runner
        self.readiness = readiness
        self._busy = busy
        self._idle_poll_s = idle_poll_s
        self.first_runs = jax.default_backend() == "cpu" if first_runs is None else first_runs
        self.compilations = compile_counter.CompileCounter()
        self.seconds = 0.0                 # wall clock from start to the last bucket
        self.failed: list[tuple[tuple[int, int], str]] = []   # buckets left unready, and why
        self.helpers_failed: list[tuple[str, str]] = []         # helpers left unbuilt, and why
        self._stop = threading.Event()
        self._helpers: tuple[tuple[str, Callable[[], object]], ...] = ()
        self._thread = threading.Thread(target=self._run, name="jaxserve-bucket-warmup", daemon=True)

    def start(self, helpers: Sequence[tuple[str, Callable[[], object]]] = ()) -> "BackgroundWarmUp":
        """Start the thread; `helpers`: (name, build) pairs it calls before the buckets."""
        self._helpers = tuple(helpers)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Warm no further bucket (the one in progress finishes) and wait up to `timeout` s."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True if it has."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        t0 = time.perf_counter()
        arena = None
        with compile_counter.attributed_to(self.compilations):
            self._build_helpers()
            for bucket in self.readiness.pending():
                if self._stop.is_set():
                    break
                before_bucket(bucket)
                if bucket in self.readiness.plan.when_idle:
                    while self._busy() and not self._stop.is_set():
                        self._stop.wait(self._idle_poll_s)   # serving needs the cores more
                if self._stop.is_set():
                    break
                try:
                    self.runner.load_executables([bucket])
                    if self.first_runs:
                        if arena is None:
                            arena = _scratch_arena(self.runner)
                        arena = run_on(self.runner, bucket, arena)
                except Exception as e:  # noqa: BLE001 - a bucket that fails stays unready; steps pad into warm ones
                    log.warning("warm-up: bucket %s failed (%s); steps run in the warm buckets that hold them", bucket, e)
                    self.failed.append((bucket, repr(e)))
                    arena = None       # a failed run may have consumed the donated scratch arena
                    continue
                self.readiness.mark_ready([bucket])
        del arena
        self.seconds = time.perf_counter() - t0
        if self.readiness.all_ready:
            log.info("warm-up: all %d buckets ready, %.1f s in the background (%d compiled there)",
                     self.readiness.total, self.seconds, self.compilations.count)
        else:
            log.info("warm-up stopped after %.1f s: %s", self.seconds, self.readiness.describe())


    def _build_helpers(self) -> None:
        # first: they take seconds, the buckets minutes, and a request that needs one before it is
        # built stalls the step thread to build it (a compilation on the serving path)
        for name, build in self._helpers:
            if self._stop.is_set():
                return
            try:
                build()
            except Exception as e:  # noqa: BLE001 - its first user builds it again, and meets the error itself
                log.warning("warm-up: %s failed (%s); its first request builds it", name, e)
                self.helpers_failed.append((name, repr(e)))


def run_on(runner, bucket: tuple[int, int], arena):
    """Run `bucket`'s step and sampler (or its step with the sampler fused in) once on the null block of `arena` (not the engine's), with
    zero previous-step tokens, and wait; returns the arena the step hands back (it donates it)."""
    # a batch of its own: the engine's seats (the runner's persistent batch) stay as they are
    packed = PersistentBatch(runner.shapes, mask_words=runner.mask_words).pack(warm_up_step(runner.shapes, bucket), {})
    step, sampler = runner.step_and_sampler(bucket)
    prev = np.zeros((runner.max_sample_rows,), np.int32)
    with runner.params_lock:    # a LoRA slot write waits: it would delete the slot arrays read here
        if sampler is None:     # the step samples itself (one launch per step)
            sampling = runner.sampler.inputs(sample_rows_bucket(*bucket), packed.sampling)
            arena, out, *_ = step(runner.params, arena, packed.arrays, prev, sampling)
        else:
            arena, logits, *_ = step(runner.params, arena, packed.arrays, prev)
            out = sampler(logits, packed.sampling, prev)
        jax.block_until_ready(out["tokens"])
    return arena


def _scratch_arena(runner):
    sharding = None
    if runner.mesh is not None:
        from jaxserve.parallel.sharding import arena_sharding

        sharding = arena_sharding(runner.mesh)
    return allocate_arena(runner.arena_spec, sharding=sharding)
