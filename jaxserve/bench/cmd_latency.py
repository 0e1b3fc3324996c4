"""`jaxserve bench latency`: fixed batches of fixed-length requests, timed end to end.

For each backend and each `--batch-size`, `--num-iters` iterations each send B requests of exactly
`--input-len` prompt tokens and `--output-len` output tokens at once and time the whole batch.
Batch 1 gives the single-stream decode latency (median TPOT); a list of batch sizes gives the
throughput-against-batch curve that `jaxserve plan` reads for its knee.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import numpy as np

from jaxserve.bench import plots
from jaxserve.bench.args import add_common, set_command
from jaxserve.bench.backend_base import BackendRun
from jaxserve.bench.backends import parse_backends
from jaxserve.bench.metrics import summarize
from jaxserve.bench.session import Session, log
from jaxserve.bench.workloads import LengthRange, Workload, edit_workload, random_workload, with_temperature


def add_parser(sub: Any) -> None:
    p = sub.add_parser("latency", help="end-to-end latency of fixed batches; batch-size sweeps for `plan`",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "jaxserve,hf")
    p.add_argument("--batch-size", default="1", help="comma-separated batch sizes, e.g. 1,2,4,8,16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--dataset", choices=("random", "edit"), default="random",
                   help="edit: correct and write out a given text (repetitive output); --input-len is then the text's")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature, seeded per request (0: greedy; jaxserve only)")
    set_command(p, run)


def _batch_sizes(text: str) -> list[int]:
    sizes = [int(t) for t in text.split(",") if t.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size must list positive integers, got {text!r}")
    return sizes


def sweep_point(batch_size: int, iteration_latencies: list[float], run: BackendRun, output_len: int) -> dict[str, Any]:
    lat = np.asarray(iteration_latencies)
    m = summarize(run.records, run.duration_s)
    return {
        "batch_size": batch_size,
        "latency_mean_s": float(lat.mean()),
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p99_s": float(np.percentile(lat, 99)),
        "ttft_mean_s": m.ttft.mean,
        "tpot_median_s": m.tpot.median,
        "output_tok_s": batch_size * output_len / float(lat.mean()),
    }


def _sweep_backend(session: Session, backend: Any, label: str, args: argparse.Namespace, sizes: list[int],
                   pool: Workload, offsets: dict[int, int], runs: list) -> list[dict[str, Any]]:
    """Every batch size through one backend; appends its runs and returns its sweep points."""
    points = []
    for b in sizes:
        if hasattr(backend, "batch_size"):
            backend.batch_size = b  # static batching: the whole batch is one generate call
        merged, lats = None, []
        for it in range(-args.num_iters_warmup, args.num_iters):
            first = offsets[b] + (it + args.num_iters_warmup) * b
            reqs = [replace(r, request_id=f"lat-b{b}-it{it}-{i}")
                    for i, r in enumerate(pool.requests[first:first + b])]
            log(f"{backend.label}: batch {b}, iteration {it}")
            r = session.run(backend, reqs, session.options(), {"batch_size": b})
            if r is None or it < 0:
                continue
            lats.append(r.duration_s)
            if merged is None:
                merged = r
            else:
                merged.records += r.records
                merged.output_token_ids.update(r.output_token_ids)
        if merged is None:
            break
        merged.duration_s = float(sum(lats))
        merged.label = f"{label}[batch={b}]"
        merged.config["iteration_latencies_s"] = lats
        runs.append(merged)
        points.append(sweep_point(b, lats, merged, args.output_len))
    return points


def run(args: argparse.Namespace) -> dict[str, Any]:
    session = Session(args, "latency")
    sizes = _batch_sizes(args.batch_size)
    if args.num_iters < 1:
        raise ValueError(f"--num-iters must be >= 1, got {args.num_iters}")
    fixed = LengthRange(args.input_len, args.input_len), LengthRange(args.output_len, args.output_len)
    # every (batch size, iteration) gets its own prompts, so no run is answered from a prefix cache
    per_size = args.num_iters_warmup + args.num_iters
    if args.dataset == "edit":
        pool = edit_workload(session.tokenizer, sum(sizes) * per_size, fixed[1], seed=args.seed)
    else:
        pool = random_workload(session.tokenizer, sum(sizes) * per_size, *fixed, seed=args.seed)
    pool = with_temperature(pool, args.temperature)
    offsets = {b: sum(sizes[:j]) * per_size for j, b in enumerate(sizes)}
    runs, sweep = [], {}
    session.sized_for(pool)
    for name in parse_backends(args.backend):
        backends = session.build_with_speculation(name)
        try:
            for backend in backends:
                # the backend's name, or with speculation "jaxserve" and "jaxserve+spec"
                label = backend.label if len(backends) > 1 else name
                sweep[label] = _sweep_backend(session, backend, label, args, sizes, pool, offsets, runs)
        finally:
            for backend in backends:
                backend.close()

    def throughput_vs_batch(result: dict[str, Any], path: str) -> str:
        series = {k: ([p["batch_size"] for p in v], [p["output_tok_s"] for p in v]) for k, v in sweep.items()}
        return plots.curve("output throughput against batch size", "batch size", "output tokens / s", series, path)

    workload = Workload("latency", pool.requests, {
        "batch_sizes": sizes, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "seed": args.seed})
    return session.finish(workload, runs, extra={"latency_sweep": sweep},
                          plots=[plots.latency_cdfs] + ([throughput_vs_batch] if len(sizes) > 1 else []))
