"""Start-up calibration: the timings the engine's policies are derived from, measured or remembered.

Two policies need timings of this machine: the default prefill chunk (engine/chunk_policy.py:
decode-only step times and the rate a chunk adds to a decode batch) and preemption's swap-or-
recompute choice (host_swap.SwapCostModel: swap bandwidth against prefill throughput). Measuring
runs the compiled steps on scratch blocks 1, 2, ..., so it happens before the engine takes a
request (or, for a server warming in the background, once it is idle with its prefix cache
emptied: engine/deferred_calibration.py), and it costs seconds of every start (a full-budget
prefill three times, decode batches, swap round trips) for numbers that only change with the
machine and the configuration.

So a `Calibrator` looks each measurement up in a `CalibrationCache` first: one JSON file per
`CalibrationKey` (checkpoint identity, the resolved shapes and sizes the steps run at, software,
machine), holding every measurement taken under that key. A measurement taken on a busy machine
is remembered as it was; deleting the file (or `cache_dir=""`) measures again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from jaxserve.checkpoints.disk_cache import DiskCache
from jaxserve.runner import fingerprint
from jaxserve.runner.batch import bucket_for
from jaxserve.runner.host_swap import SwapCostModel
from jaxserve.runner.scratch import scratch_request, scratch_step

log = logging.getLogger(__name__)

FORMAT = 2      # 2: prompt tiles split into requests that fit max_model_len (measured anew)


@dataclass(frozen=True, slots=True)
class CalibrationKey:
    """Everything a measured timing depends on."""

    checkpoint: str          # checkpoint identity
    engine: dict             # the resolved shapes, sizes and compiler settings the steps run at
    software: dict
    machine: dict

    @classmethod
    def for_runner(cls, runner, checkpoint_identity: str) -> "CalibrationKey":
        shapes, arena = runner.shapes, runner.arena_spec
        engine = {
            "shapes": dataclasses.asdict(shapes),
            "arena": dataclasses.asdict(arena),
            "host_blocks": runner.host_pool.num_blocks if runner.host_pool is not None else 0,
            "attention_impl": runner.attention_impl,
            "compiler_options": runner.compiler_options,
        }
        return cls(checkpoint_identity, engine, fingerprint.software(), fingerprint.machine())

    def file_name(self) -> str:
        blob = json.dumps(self.as_json(), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest() + ".json"

    def as_json(self) -> dict:
        # through JSON and back, so a key compares equal to the one read from a file (tuples -> lists)
        return json.loads(json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True))


class CalibrationCache:
    """Measurements by key, one file each; a file whose stored key differs is a miss."""

    def __init__(self, directory: str):
        self._disk = DiskCache(directory)

    def load(self, key: CalibrationKey) -> dict[str, object]:
        entry = self._disk.get_json(key.file_name())
        if not isinstance(entry, dict) or entry.get("key") != key.as_json():
            return {}
        return dict(entry.get("measurements") or {})

    def store(self, key: CalibrationKey, measurements: dict[str, object]) -> None:
        self._disk.put_json(key.file_name(), {"key": key.as_json(), "measurements": measurements})


class CalibrationMiss(LookupError):
    """A measurement the cache does not hold, asked of a Calibrator that may not measure."""


class Calibrator:
    """The runner's start-up measurements, each taken at most once per key (see the module doc)."""

    def __init__(self, runner, *, cache: CalibrationCache | None = None, key: CalibrationKey | None = None,
                 measure: bool = True):
        """measure=False: only what the cache (or the runner) holds; a miss raises CalibrationMiss
        (the builder then defers the calibration until the engine is idle: engine/builder.py)."""
        self.runner = runner
        self.may_measure = measure
        self.shapes = runner.shapes
        self._cache = cache if key is not None else None
        self._key = key
        # kept on the runner, so a later engine on the same runner (tests, bench variants) reuses them
        self.measurements: dict[str, object] = runner.measurements
        if self._cache is not None:
            self.measurements.update(self._cache.load(key))
        self.measured: list[str] = []      # names measured by this calibrator (cache misses)
        self.reused: list[str] = []        # names found in the cache

    # -- the measurements ----------------------------------------------------------------------
    def measure_prefill_throughput(self, repeats: int = 2) -> float:
        """Prompt tokens per second of the largest prefill bucket, written into scratch blocks."""
        def measure() -> float:
            chunk = self._prefill_chunk("calibrate", self.shapes.prefill_buckets[-1], 0)
            n = sum(len(r.token_ids) for r in chunk)
            return n / self._best_time(scratch_step(chunk), repeats)

        return self._remember("prefill_tokens_per_s", measure)

    def measure_decode_step_time(self, context: int = 256, repeats: int = 2, rows: int | None = None) -> float:
        """Seconds of a decode-only step of `rows` decodes (default: a full batch, the largest
        bucket of steps that also carry prompt tiles), every row at `context` tokens. The rows
        share one block table of scratch blocks, so this works however small the arena is."""
        rows = rows or self.shapes.decode_buckets[-1]
        context = self._decode_context(context)
        return self._remember(f"decode_step_s(rows={rows},context={context})",
                              lambda: self._best_time(scratch_step(self._decode_rows(context, rows)), repeats))

    def measure_chunk_rate(self, chunk_tiles: int = 1, decode_context: int = 256, repeats: int = 2) -> float:
        """Prompt tokens per second that a chunk of `chunk_tiles` tiles adds to a full decode
        batch, the chunk at the deepest position a prompt reaches (max_model_len less the chunk):
        (chunk tokens) / (mixed step - decode-only step). A chunk's attention reads its whole
        context, so the deepest chunk is the costliest, and an ITL bound that is to hold for every
        chunk of a prompt (the p99, not the mean) must be sized by it. The largest-bucket prefill
        from an empty context (measure_prefill_throughput) overstates this rate several times."""
        tiles = min(chunk_tiles, self.shapes.prefill_buckets[-1])
        chunk = tiles * self.shapes.prefill_tile
        decode_context = self._decode_context(decode_context)
        depth = self.prefill_depth(tiles, self.shapes.max_model_len)

        def measure() -> float:
            rows = self._decode_rows(decode_context)
            decode_only = self._best_time(scratch_step(rows), repeats)
            mixed = self._best_time(scratch_step(rows + self._prefill_chunk("calibrate-chunk", tiles, depth)),
                                    repeats)
            return chunk / max(mixed - decode_only, 1e-6)

        return self._remember(f"chunk_tokens_per_s(chunk={chunk},depth={depth},decode_context={decode_context})",
                              measure)

    def measure_prefill_step_time(self, tiles: int, depth: int = 0, repeats: int = 2) -> float:
        """Seconds that a chunk of `tiles` prefill tiles after `depth` cached tokens adds to a step
        of one decode (at context 256): the step-cost model's prefill term (sched/step_cost.py).
        `depth` is cut to what the engine can hold (prefill_depth); tiles more than one request
        can hold are split over several requests, as a step of several prompts carries them."""
        depth = self.prefill_depth(tiles, depth)
        decode_context = self._decode_context(256)

        def measure() -> float:
            rows = self._decode_rows(decode_context, rows=1)
            decode_only = self._best_time(scratch_step(rows), repeats)
            mixed = self._best_time(scratch_step(rows + self._prefill_chunk("calibrate-chunk", tiles, depth)),
                                    repeats)
            return max(mixed - decode_only, 0.0)

        return self._remember(f"prefill_step_s(tiles={tiles},depth={depth},decode_context={decode_context})", measure)

    def measure_swap_cost(self) -> SwapCostModel:
        """The cost model behind preemption_mode="auto": swap bandwidth and fixed cost against
        prefill throughput, measured on this machine."""
        fixed_s, per_block_s = self._remember("swap_fixed_and_per_block_s", lambda: list(self.runner.time_swaps()))
        model = SwapCostModel(fixed_s, per_block_s, self.measure_prefill_throughput(), self.shapes.block_size)
        log.info("swap cost model: %s; recompute is cheaper below %d tokens", model, model.crossover_tokens())
        return model

    def save(self) -> None:
        """Keep what was measured for the next start under the same key."""
        if self._cache is not None and self.measured:
            self._cache.store(self._key, self.measurements)

    # -- helpers -------------------------------------------------------------------------------
    def _remember(self, name: str, measure: Callable):
        if name in self.measurements:
            if name not in self.reused:
                self.reused.append(name)
            return self.measurements[name]
        if not self.may_measure:
            raise CalibrationMiss(name)
        value = measure()
        self.measurements[name] = value
        self.measured.append(name)
        return value

    def _capacity(self) -> int:
        """Tokens the scratch blocks 1 .. num_blocks - 1 hold."""
        return (self.runner.arena_spec.num_blocks - 1) * self.shapes.block_size

    def _request_limit(self) -> int:
        """The most tokens (cached and new) one scratch request may span: what a real request can
        (max_model_len, which the block tables are sized for) and what the scratch blocks hold."""
        return min(self.shapes.max_model_len, self._capacity())

    def _piece_tokens(self, tiles: int) -> int:
        """Tokens of the largest piece a chunk of `tiles` tiles is split into: whole tiles, within
        one request's limit."""
        tile = self.shapes.prefill_tile
        return min(tiles * tile, max(tile, self._request_limit() // tile * tile))

    def prefill_depth(self, tiles: int, depth: int) -> int:
        """`depth` cut so that a chunk of `tiles` tiles after it fits one request: the deepest
        context the engine can have a chunk at, when asked for more."""
        return max(0, min(depth, self._request_limit() - self._piece_tokens(tiles)))

    def _prefill_chunk(self, request_id: str, tiles: int, depth: int) -> list:
        """Scratch requests carrying `tiles` prompt tiles after `depth` cached tokens each, as few
        as fit: one unless the tiles exceed what a request may span (a short max_model_len)."""
        piece = self._piece_tokens(tiles)
        left = tiles * self.shapes.prefill_tile
        requests = []
        while left > 0:
            n = min(piece, left)
            requests.append(self._scratch(f"{request_id}-{len(requests)}", n, min(depth, self._request_limit() - n)))
            left -= n
        return requests

    def _decode_context(self, context: int) -> int:
        return max(1, min(context, self.shapes.max_model_len - 1, self._capacity()))

    def _scratch(self, request_id: str, num_tokens: int, num_computed: int):
        return scratch_request(request_id, num_tokens, num_computed, block_size=self.shapes.block_size)

    def _decode_rows(self, context: int, rows: int | None = None) -> list:
        """A decode batch (default: a full one, which can also carry a chunk) at `context` tokens
        on shared scratch blocks."""
        rows = rows or self.shapes.decode_buckets[-1]
        return [self._scratch(f"calibrate-{i}", 1, context - 1) for i in range(rows)]

    def _best_time(self, step, repeats: int) -> float:
        """The fastest of `repeats` runs of `step`, after one untimed run (which loads the bucket's
        executables where needed and pays their first run)."""
        self.runner.load_executables([bucket_for(step, self.shapes)])
        self.runner.execute(step)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            self.runner.execute(step)
            best = min(best, time.perf_counter() - t)
        return best
