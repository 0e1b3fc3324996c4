"""`jaxserve bench host`: the host's milliseconds per decode step, and its parts, per batch size.

On a GPU the device finishes a decode step in a few milliseconds; the one-step-ahead loop hides
the host's work only while that work is shorter. This command measures the host's share alone: a
tiny random model (`--shape tiny`: the model's own compute is negligible on our CPU), one engine
compiled once (a decode-only step shape per measured batch size, one mixed shape for the
prompts), and for each batch size a fresh engine sharing its runner, `B` requests of
`--input-len` random prompt tokens and exactly `--output-len` greedy outputs each, all sent at
once. The engine is stepped by hand; every step's wall time is split into

  schedule   Scheduler.schedule
  pack       the runner turning the SchedulerOutput into arrays (dispatch minus run_inputs)
  dispatch   ModelRunner.run_inputs: the compiled calls, started asynchronously
  collect    ModelRunner.collect, less the time it waited for the device
  update     Scheduler.update
  outputs    OutputProcessor.process
  wait       time waiting for the device (not host time)
  gc         Python's garbage collections during the step (inside the parts above, not added;
             the mean per step, since they run in some steps only)

Beside them, `admit_schedule_ms`: Scheduler.schedule in the round's first step, which admits the
whole burst of B waiting requests (as many as the step's token budget takes).

and `host` = the step's wall time less `wait` (what `stats().steps.host_ms_per_step` counts). Only
steps where every running request decodes are kept (the prefill steps at the start and the short
steps at the end are not), and medians over them are reported, per `--rounds` round and over
rounds. `--profile DIR` also writes a cProfile of each batch size's steady decode steps
(DIR/host-B.prof) and prints its top functions by own time.

The parts are measured by wrapping those methods on the engine's own objects (no module is
patched), so the command also runs from an older checkout (run_from_checkout.py) for a
before/after comparison on the same machine.

`--without-model` times schedule, pack and update alone (host_without_model.py): with a model,
a long `--input-len` lengthens the device's step and on a CPU evicts the host's caches.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from jaxserve.bench.args import set_command
from jaxserve.bench.environment import environment
from jaxserve.bench.results import write_result
from jaxserve.bench.session import log

PARTS = ("schedule", "pack", "dispatch", "collect", "update", "outputs")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("host", help="host ms per decode step and its parts per batch size (tiny model)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or GGUF; default: a random model of --shape")
    p.add_argument("--shape", default="tiny", help="random model shape when --model is not given")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the engine's dtype (and the random model's); bfloat16 for a GPU's device time")
    p.add_argument("--batch-sizes", default="1,16,64,256", help="running requests, comma-separated")
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="rounds per batch size; medians over rounds reported")
    p.add_argument("--no-async-scheduling", action="store_true", help="step without the one-step-ahead loop")
    p.add_argument("--output-kind", default="delta", choices=("delta", "cumulative", "final_only"),
                   help="the requests' outputs: delta (a streaming server's), final_only (LLM.generate's)")
    p.add_argument("--profile", default=None, metavar="DIR", help="also cProfile each batch size's decode steps")
    p.add_argument("--cache-dir", default=None,
                   help="keep the random model and the compiled executables here between runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine argument over this command's own (repeatable; Python literals, e.g. "
                        "fuse_sampler=False for the two-launch step)")
    p.add_argument("--without-model", action="store_true",
                   help="time schedule, pack and update alone, no model (host_without_model.py): the host "
                        "path's growth with --input-len, apart from the device's")
    p.add_argument("--steps", type=int, default=60, help="with --without-model: timed decode steps per round")
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--name", default=None, help="file stem of the JSON result (default: host-UTC-TIMESTAMP)")
    p.add_argument("--no-progress", action="store_true")
    set_command(p, run)


class _Clock:
    """Per-step seconds spent inside the wrapped methods."""

    def __init__(self) -> None:
        self.parts = dict.fromkeys(PARTS + ("run_inputs", "wait", "gc"), 0.0)
        self._gc_started = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        # gc.callbacks: a collection starts and stops (whichever part allocated when it ran)
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.parts["gc"] += time.perf_counter() - self._gc_started

    def reset(self) -> None:
        for k in self.parts:
            self.parts[k] = 0.0

    def wrap(self, obj: Any, method: str, part: str) -> None:
        inner = getattr(obj, method)
        parts = self.parts

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                parts[part] += time.perf_counter() - t

        setattr(obj, method, timed)


def _instrument(engine: Any, clock: _Clock) -> None:
    runner = engine.runner
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(runner, "dispatch", "pack")          # the run_inputs inside it is subtracted below
    clock.wrap(runner, "run_inputs", "run_inputs")
    clock.wrap(engine.scheduler, "update", "update")
    clock.wrap(engine.outputs, "process", "outputs")
    inner_collect = runner.collect
    parts = clock.parts

    def collect(handle):
        # the wait for the device is the time until the sampled tokens are ready; the rest is host
        t = time.perf_counter()
        out = handle.sampler_out
        if out is not None:
            out["tokens"].block_until_ready()
        w = time.perf_counter()
        result = inner_collect(handle)
        parts["wait"] += w - t
        parts["collect"] += time.perf_counter() - w
        return result

    runner.collect = collect


def _uninstrument(engine: Any) -> None:
    for obj in (engine.scheduler, engine.runner, engine.outputs):
        for name in ("schedule", "dispatch", "run_inputs", "update", "process", "collect"):
            obj.__dict__.pop(name, None)


def _one_round(llm, prompts, params, batch: int, profiler=None) -> dict[str, Any]:
    engine = llm.engine
    clock = _Clock()
    _instrument(engine, clock)
    for i in range(batch):
        engine.add_request(f"r{i}", prompts[i], params)
    rows = []
    admit_s = None
    gc.callbacks.append(clock.on_gc)
    try:
        while engine.has_unfinished_requests():
            first = admit_s is None
            clock.reset()
            decoding = _all_decoding(engine, batch)
            if profiler is not None and decoding:
                profiler.enable()
            t = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t
            if profiler is not None and decoding:
                profiler.disable()
            if first:     # the step that takes in the whole burst
                admit_s = clock.parts["schedule"]
            if decoding:
                p = dict(clock.parts)
                p["dispatch"] = p.pop("run_inputs")
                p["pack"] -= p["dispatch"]      # dispatch = pack + run_inputs
                rows.append((wall, p))
    finally:
        gc.callbacks.remove(clock.on_gc)
        _uninstrument(engine)
    if not rows:
        raise SystemExit(f"jaxserve bench host: no all-decode step at batch {batch} (raise --output-len)")
    host = [wall - p["wait"] for wall, p in rows]
    out = {"steps": len(rows), "host_ms": 1000 * statistics.median(host),
           "wall_ms": 1000 * statistics.median(w for w, _ in rows),
           "stats_host_ms_per_step": llm.stats().steps.host_ms_per_step,
           "compilations_after_warmup": llm.stats().steps.num_compilations_after_warmup}
    for part in PARTS + ("wait",):
        out[f"{part}_ms"] = 1000 * statistics.median(p[part] for _, p in rows)
    # collections run in some steps only (a median would read 0): the mean per step, and the
    # host's mean beside its median
    out["gc_ms"] = 1000 * statistics.mean(p["gc"] for _, p in rows)
    out["host_mean_ms"] = 1000 * statistics.mean(host)
    out["admit_schedule_ms"] = 1000 * admit_s
    return out


def _all_decoding(engine: Any, batch: int) -> bool:
    """Whether every request is running and past its prompt (the next step decodes all of them,
    and one is in flight with the async loop), with several outputs still to come."""
    sched = engine.scheduler
    running = list(sched.running) if hasattr(sched, "running") else []
    if len(running) != batch:
        return False
    for r in running:
        if r.num_computed_tokens < r.num_prompt_tokens or r.max_tokens - r.num_output_tokens < 3:
            return False
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.random_model import MARKER, make_random_hf_model

    batches = sorted({int(b) for b in args.batch_sizes.split(",")})
    if args.without_model:
        return _run_without_model(args, batches)
    if batches[0] < 1 or args.rounds < 1 or args.input_len < 1 or args.output_len < 8:
        raise SystemExit("jaxserve bench host: batch sizes and --rounds >= 1, --input-len >= 1, --output-len >= 8")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model, tmp = args.model, None
    if model is None:
        if args.cache_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="jaxserve-host-")
        where = args.cache_dir if args.cache_dir is not None else tmp.name
        model = os.path.join(where, f"model-{args.shape}-{args.dtype}-{args.seed}")
        if not os.path.exists(os.path.join(model, MARKER)):   # kept: its cached executables stay valid
            make_random_hf_model(model, args.shape, dtype=args.dtype, seed=args.seed)
    max_len = args.input_len + args.output_len
    log(f"building the engine ({args.shape if args.model is None else model}, max_num_seqs {batches[-1]})")
    engine = dict(max_num_seqs=batches[-1], max_model_len=max(max_len, 64), dtype=args.dtype,
                  async_scheduling=not args.no_async_scheduling, progress=not args.no_progress,
                  # no start-up measurements this command does not use (decode steps only): a fixed
                  # prefill chunk instead of a calibrated one, and no swap space to time
                  long_prefill_token_threshold=max(max_len, 64), swap_space=0,
                  # and only the step shapes it runs: the measured batch sizes decode-only, one mixed
                  # shape for the prompts (the default ~50 shapes took over 146 s to compile on an H200)
                  **_buckets(batches),
                  **({"cache_dir": args.cache_dir} if args.cache_dir is not None else {}))
    base = LLM(model, **{**engine, **_engine_args(args)})
    vocab = base.engine.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()} for _ in range(batches[-1])]
    params = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0,
                            ignore_eos=True, output_kind=args.output_kind)
    warm = prompts[:2]
    base.generate(warm, [params] * len(warm), use_tqdm=False)   # warm the host-side paths too
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    per_batch = {}
    for batch in batches:
        rounds = []
        for _ in range(args.rounds):
            llm = LLM.sharing_runner(base, async_scheduling=not args.no_async_scheduling)
            rounds.append(_one_round(llm, prompts, params, batch))
        row = {"rounds": rounds, **{k: statistics.median(r[k] for r in rounds)
                                    for k in ("host_ms", "host_mean_ms", "admit_schedule_ms", "stats_host_ms_per_step")
                                    + tuple(f"{p}_ms" for p in PARTS + ("wait", "gc"))}}
        row["compilations_after_warmup"] = max(r["compilations_after_warmup"] for r in rounds)
        if args.profile:
            row["profile"] = _profile(base, prompts, params, batch, args)
        per_batch[batch] = row
        log(f"batch {batch}: host {row['host_ms']:.2f} ms/step (rounds "
            + ", ".join(f"{r['host_ms']:.2f}" for r in rounds) + "); "
            + ", ".join(f"{p} {row[p + '_ms']:.3f}" for p in PARTS))
    if tmp is not None:
        tmp.cleanup()
    first = per_batch[batches[0]]["host_ms"]
    summary = {"host_ms": {b: r["host_ms"] for b, r in per_batch.items()},
               "ratio_to_smallest": {b: r["host_ms"] / first for b, r in per_batch.items()}}
    result = {"subcommand": "host", "created_utc": started,
              "config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")},
              "environment": environment(), "batches": per_batch, "summary": summary}
    path = write_result(result, args.output_dir, args.name)
    print(_table(per_batch))
    print(f"result: {path}")
    return result


def _run_without_model(args: argparse.Namespace, batches: list[int]) -> dict[str, Any]:
    from jaxserve.bench import host_without_model

    if batches[0] < 1 or args.rounds < 1 or args.input_len < 1 or args.steps < 1:
        raise SystemExit("jaxserve bench host --without-model: batch sizes, --rounds, --input-len, --steps >= 1")
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    per_batch = host_without_model.measure(batches, args.input_len, args.steps, args.rounds, args.seed)
    for b, row in per_batch.items():
        log(f"batch {b}: schedule + pack + update {row['host_ms']:.3f} ms/step (rounds "
            + ", ".join(f"{r['host_ms']:.3f}" for r in row["rounds"]) + ")")
    result = {"subcommand": "host", "created_utc": started,
              "config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")},
              "environment": environment(), "batches": per_batch,
              "summary": {"host_ms": {b: r["host_ms"] for b, r in per_batch.items()}}}
    path = write_result(result, args.output_dir, args.name)
    print(host_without_model.table(per_batch))
    print(f"result: {path}")
    return result


def _engine_args(args) -> dict:
    """--engine-arg KEY=VALUE pairs (bench/args.py's spelling), without its dtype default."""
    from jaxserve.bench.args import engine_kwargs

    kw = engine_kwargs(argparse.Namespace(dtype=args.dtype, engine_arg=getattr(args, "engine_arg", [])))
    kw.pop("dtype")
    return kw


def _buckets(batches: list[int]) -> dict[str, tuple[int, ...]]:
    from jaxserve.engine_args import default_arg
    from jaxserve.llm import OFFLINE_PREFILL_TILE     # LLM's tile (the engine's own default is smaller)

    tiles = default_arg("max_num_batched_tokens") // OFFLINE_PREFILL_TILE
    # the mixed buckets need 1 and the largest batch (one entry when that is 1 itself)
    return {"decode_buckets": tuple(sorted({1, batches[-1]})), "decode_only_buckets": tuple(batches),
            "prefill_buckets": (0, tiles)}


def _profile(base, prompts, params, batch: int, args) -> str:
    import cProfile
    import pstats

    from jaxserve import LLM

    prof = cProfile.Profile()
    llm = LLM.sharing_runner(base, async_scheduling=not args.no_async_scheduling)
    _one_round(llm, prompts, params, batch, profiler=prof)
    path = os.path.join(args.profile, f"host-{batch}.prof")
    prof.dump_stats(path)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    text = buf.getvalue()
    with open(os.path.join(args.profile, f"host-{batch}.txt"), "w") as f:
        f.write(text)
    return path


def _table(per_batch: dict) -> str:
    head = "| running | host ms | " + " | ".join(PARTS) + " | wait | gc | x batch-1 | admitting all: schedule ms |"
    lines = [head, "|" + "---|" * (len(PARTS) + 6)]
    first = next(iter(per_batch.values()))["host_ms"]
    for b, r in per_batch.items():
        lines.append(f"| {b} | {r['host_ms']:.2f} | " + " | ".join(f"{r[p + '_ms']:.3f}" for p in PARTS)
                     + f" | {r['wait_ms']:.3f} | {r['gc_ms']:.3f} | {r['host_ms'] / first:.1f} | "
                     f"{r['admit_schedule_ms']:.2f} |")
    return "\n".join(lines)
