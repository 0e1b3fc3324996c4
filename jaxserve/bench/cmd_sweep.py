"""`jaxserve bench sweep`: decode step time across engine configurations, so no setting falls off a cliff.

Issue 14 found one: max_model_len=1024 decoded at batch 1 32x slower than the default 8,192. For
each configuration of a grid over max_model_len, max_num_seqs, block_size and prefill_tile
(jaxserve/bench/sweep_grid.py; one axis at a time from the default unless `--grid full`), this
builds an engine and times its decode-only steps at batch 1 and at a full batch (max_num_seqs
rows), medians of `--steps` steps or more (jaxserve/bench/decode_steps.py), then gives each
configuration's per-token time against the default's and flags those beyond `--flag-ratio`.

The default engine stays loaded and is timed again beside each configuration, batch size by
batch size (`--repeats` rounds in turn), and each ratio is to the timing beside it (the median
round's): on a shared machine the load changes over minutes (the default's own full-batch step
varied 2x over one sweep at a load average of 5-9), and a ratio to a timing taken ten minutes
earlier would flag the machine, not the configuration. Two engines are in memory at a time; every
timing sends fresh prompts, so none is served from the prefix cache.

Only the buckets the measurement runs are compiled: decode-only steps of 1 and max_num_seqs rows,
and one mixed bucket that carries the prompts in. A bucket's step does the same work whichever
other buckets are compiled, so what is timed is what a default engine of that configuration runs;
the persistent compilation cache serves shapes that recur (e.g. the batch-1 step of every
max_num_seqs). A smaller max_num_seqs costs more per token at full batch by nature (fewer rows
share each weight read), so its full batch is compared with the default engine running that many
rows (the default compiles those decode-only steps too); a larger one, with the default's full
batch.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import os
import tempfile
import time
import traceback
from typing import Any, Iterable, Iterator

from jaxserve.bench.args import engine_kwargs, jsonable_args, set_command
from jaxserve.bench.decode_steps import PairedTiming, measure_decode, time_beside
from jaxserve.bench.environment import environment
from jaxserve.bench.random_model import SHAPES
from jaxserve.bench.results import build_result, write_result
from jaxserve.bench.session import log
from jaxserve.bench.sweep_grid import AXES, GRIDS, SweepPoint, parse_values, sweep_points
from jaxserve.runner.buckets import RunnerShapes

FLAG_NAMES = {"batch1": "batch 1", "full_batch": "full batch"}
DEFAULT_AXES = {"max_model_len": "512,1024,2048,4096,8192", "max_num_seqs": "8,16,32,64",
                "block_size": "8,16,32", "prefill_tile": "8,16,32"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sweep", help="batch-1 and full-batch decode step time across engine configurations",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2 GGUF)")
    g.add_argument("--random-shape", default=None, choices=tuple(SHAPES),
                   help="random weights of this shape instead of --model (decode speed does not depend on the "
                        "weights' values)")
    g.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other EngineConfig field for every configuration, value as a Python literal (repeatable)")
    s = p.add_argument_group("grid")
    for axis in AXES:
        s.add_argument("--" + axis.replace("_", "-"), default=DEFAULT_AXES[axis], help="comma-separated values")
    s.add_argument("--grid", choices=GRIDS, default="axes",
                   help="axes: one axis varied at a time from the default configuration; full: every combination")
    m = p.add_argument_group("measurement")
    m.add_argument("--input-len", type=int, default=128, help="prompt tokens of every request")
    m.add_argument("--steps", type=int, default=8, help="at least this many decode steps timed per batch")
    m.add_argument("--repeats", type=int, default=1,
                   help="rounds of (default, configuration) timings in turn; each ratio is the median round's")
    m.add_argument("--flag-ratio", type=float, default=2.0,
                   help="flag a configuration whose per-token time exceeds the default's by more than this")
    o = p.add_argument_group("output")
    o.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    o.add_argument("--output-dir", default="bench_results", help="where the JSON result goes")
    o.add_argument("--name", default=None, help="file stem of the result (default: sweep-UTC-TIMESTAMP)")
    o.add_argument("--no-progress", action="store_true", help="no compile and warm-up progress bars")
    set_command(p, run)


def _check(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    for name in ("input_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"jaxserve bench sweep: --{name.replace('_', '-')} must be >= 1")
    if not args.flag_ratio > 1:
        raise SystemExit("jaxserve bench sweep: --flag-ratio must be > 1")
    if args.model and args.random_shape:
        raise SystemExit("jaxserve bench sweep: give --model or --random-shape, not both")
    try:
        return {axis: parse_values(getattr(args, axis), "--" + axis.replace("_", "-")) for axis in AXES}
    except ValueError as e:
        raise SystemExit(f"jaxserve bench sweep: {e}") from None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve.bench.model_files import files_sha256, resolve_model

    axes = _check(args)
    started = {"git_commit": environment()["git_commit"],
               "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with tempfile.TemporaryDirectory(prefix="jaxserve-sweep-") as tmp:
        if args.random_shape:
            from jaxserve.bench.random_model import make_random_hf_model

            log(f"writing a random-weight {args.random_shape} model")
            model = make_random_hf_model(os.path.join(tmp, args.random_shape), args.random_shape, seed=args.seed)
        else:
            model = resolve_model(args.model).path
        spec = resolve_model(model)
        model_info = {"path": model if not args.random_shape else f"random:{args.random_shape}", "kind": spec.kind,
                      "files_sha256": files_sha256(spec)}
        rows, skipped = _sweep(args, model, axes)
    flagged = [r["label"] for r in rows if r["flagged"]]
    # the default's own timings over the sweep (its full batch only where it ran all its rows)
    seqs = rows[0]["settings"]["max_num_seqs"]
    drift = {"batch1": [r["default_batch1"]["median_step_ms"] for r in rows],
             "full_batch": [r["default_full_batch"]["median_step_ms"] for r in rows
                            if r["default_full_batch"]["batch"] == seqs]}
    workload = {"name": "sweep", "input_len": args.input_len, "steps": args.steps, "grid": args.grid,
                "axes": {a: list(v) for a, v in axes.items()}}
    result = build_result("sweep", jsonable_args(args), {**environment(), **started}, model_info, workload, [],
                          extra={"sweep": {"default": rows[0]["settings"], "flag_ratio": args.flag_ratio,
                                           "points": rows, "flagged": flagged, "default_median_step_ms": drift},
                                 "skipped": skipped})
    path = write_result(result, args.output_dir, args.name)
    print(format_table(rows))
    print(f"\n{len(rows)} configurations; beyond {args.flag_ratio:g}x the default's per-token time: "
          f"{', '.join(flagged) if flagged else 'none'}")
    print(f"the default, timed beside each configuration (the machine's drift; each ratio is to the timing beside "
          f"it): batch-1 step {min(drift['batch1']):.1f}-{max(drift['batch1']):.1f} ms, {seqs}-row step "
          f"{min(drift['full_batch']):.1f}-{max(drift['full_batch']):.1f} ms")
    print(f"wrote {path}")
    result["files"] = [path]
    return result


def _sweep(args: argparse.Namespace, model: str, axes: dict[str, tuple[int, ...]]) -> tuple[list, list]:
    """The default configuration, then every other point of the grid, each timed beside the default."""
    seeds = itertools.count(args.seed * 100_000)   # fresh prompts for every timing
    log("[1/?] default: building (loading weights, compiling)")
    # the default engine also runs full batches of the smaller max_num_seqs values, so that a
    # configuration's full batch is compared with the default at the same number of rows
    default, built_s = _build(args, model, None, extra_rows=axes["max_num_seqs"])
    settings = _resolved(default)
    load_before = _load_average()
    alone = {key: PairedTiming.alone(measure_decode(default, batch=b, input_len=args.input_len, steps=args.steps,
                                                    seed=next(seeds)))
             for key, b in (("batch1", 1), ("full_batch", settings["max_num_seqs"]))}
    rows = [_row(SweepPoint("default", settings, ()), default, built_s, alone, [load_before, _load_average()],
                 args.flag_ratio)]
    skipped: list[dict[str, Any]] = []
    points = sweep_points(settings, axes, args.grid)
    for i, point in enumerate(points[1:], start=2):
        log(f"[{i}/{len(points)}] {point.label}: building (loading weights, compiling)")
        llm = None
        try:
            llm, built_s = _build(args, model, point.settings)
            load_before = _load_average()
            timings = _time_beside(args, llm, default, seeds)
            rows.append(_row(point, llm, built_s, timings, [load_before, _load_average()], args.flag_ratio))
        except Exception as e:  # one configuration's failure must not lose the others
            log(f"  {point.label} failed:\n{traceback.format_exc()}")
            # named like the other commands' engine variants, so `bench report` lists it
            skipped.append({"backend": f"jaxserve[{point.label}]", "settings": point.settings,
                            "reason": f"{type(e).__name__}: {e}"})
        finally:
            del llm
            gc.collect()   # its weights and KV arena go before the next one is built
    return rows, skipped


def _build(args: argparse.Namespace, model: str, settings: dict[str, int] | None,
           extra_rows: Iterable[int] = ()) -> tuple[Any, float]:
    from jaxserve.bench.backend_jaxserve import load_llm

    t = time.perf_counter()
    llm = load_llm(model, _engine_kwargs(args, settings, extra_rows), progress=not args.no_progress)
    built_s = time.perf_counter() - t
    log(f"  built in {built_s:.0f} s")
    return llm, built_s


def _time_beside(args: argparse.Namespace, llm: Any, default: Any, seeds: Iterator[int]) -> dict[str, PairedTiming]:
    """Batch 1, then a full batch (max_num_seqs rows; the default runs as many, up to its own)."""
    seqs = llm.config.scheduler.max_num_seqs
    batches = {"batch1": (1, 1), "full_batch": (seqs, min(seqs, default.config.scheduler.max_num_seqs))}
    return {key: time_beside(llm, default, batch=b, default_batch=db, rounds=args.repeats, input_len=args.input_len,
                             steps=args.steps, seeds=seeds)
            for key, (b, db) in batches.items()}


def _row(point: SweepPoint, llm: Any, built_s: float, timings: dict[str, PairedTiming], load: list,
         flag_ratio: float) -> dict[str, Any]:
    """One configuration's timings, its per-token time against the default's beside it, and which
    batches (if any) exceed flag_ratio."""
    settings = _resolved(llm)
    # the KV table's width in blocks: the shape that decided issue 14's cliff
    width = RunnerShapes(settings["block_size"], settings["max_model_len"], settings["prefill_tile"], (1,),
                         (0,)).table_width
    row = {"label": point.label, "varied": list(point.varied), "settings": settings, "kv_table_blocks": width,
           "build_s": built_s}
    for key, t in timings.items():
        row.update({key: t.own.as_dict(), f"default_{key}": t.default.as_dict(), f"{key}_vs_default": t.ratio,
                    f"{key}_vs_default_rounds": list(t.ratios)})
    row["flagged"] = [key for key, t in timings.items() if t.ratio > flag_ratio]
    row["load_average_before_after"] = load
    b1, fb = row["batch1"], row["full_batch"]
    log(f"  batch 1: {b1['median_step_ms']:.1f} ms/step ({row['batch1_vs_default']:.2f}x the default beside it); "
        f"batch {fb['batch']}: {fb['median_step_ms']:.1f} ms/step, {fb['per_token_ms']:.2f} ms/token "
        f"({row['full_batch_vs_default']:.2f}x)")
    return row


def _engine_kwargs(args: argparse.Namespace, settings: dict[str, int] | None,
                   extra_rows: Iterable[int] = ()) -> dict[str, Any]:
    """The engine of one configuration (None: the engine's defaults), compiling only the buckets it is
    timed on: decode-only steps of 1 and max_num_seqs rows (and of `extra_rows` up to max_num_seqs),
    and one mixed bucket that carries the prompts in."""
    from jaxserve.engine_args import default_arg
    from jaxserve.llm import OFFLINE_PREFILL_TILE

    extra = engine_kwargs(argparse.Namespace(dtype=args.dtype, engine_arg=args.engine_arg))
    kw = {**extra, **(settings or {})}
    seqs = kw.get("max_num_seqs", default_arg("max_num_seqs"))
    budget = kw.get("max_num_batched_tokens", default_arg("max_num_batched_tokens"))
    tile = kw.get("prefill_tile", OFFLINE_PREFILL_TILE)
    # no swap pool: nothing is preempted in this workload, and it skips the start-up swap measurement
    rows = {1, seqs} | {r for r in extra_rows if r < seqs}
    return {"swap_space": 0, **kw, "decode_buckets": (seqs,), "decode_only_buckets": tuple(sorted(rows)),
            "prefill_buckets": (0, budget // tile)}


def _resolved(llm: Any) -> dict[str, int]:
    """A configuration's settings as the engine resolved them (an unset max_model_len: the model's limit)."""
    return {"max_model_len": int(llm.engine.max_model_len), "max_num_seqs": llm.config.scheduler.max_num_seqs,
            "block_size": llm.config.cache.block_size, "prefill_tile": llm.config.compilation.prefill_tile}


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ["configuration", "max_model_len", "max_num_seqs", "block_size", "prefill_tile", "KV table blocks",
              "batch-1 step ms", "x default", "full batch", "full-batch step ms", "ms/token", "x default",
              "beyond the flag ratio"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        s, b1, fb = r["settings"], r["batch1"], r["full_batch"]
        lines.append("| " + " | ".join([
            r["label"], *(str(s[a]) for a in AXES), str(r["kv_table_blocks"]),
            f"{b1['median_step_ms']:.1f}", f"{r['batch1_vs_default']:.2f}", str(fb["batch"]),
            f"{fb['median_step_ms']:.1f}", f"{fb['per_token_ms']:.2f}", f"{r['full_batch_vs_default']:.2f}",
            " and ".join(FLAG_NAMES[k] for k in r["flagged"])]) + " |")
    return "\n".join(lines)


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]
