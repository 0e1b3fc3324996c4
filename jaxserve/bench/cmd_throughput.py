"""`jaxserve bench throughput`: one workload through each backend, side by side.

Default: the foundation issue's workload (32 requests, prompts of 32-512 tokens of real text,
outputs of 16-256 tokens, EOS ignored, greedy), every request sent at once, through jaxserve and
HF static batching. `--request-rate` takes several rates for a sweep (TTFT against rate plot).
`--repeats N` runs the backends in turn N times (bench/repeats.py) and reports medians and the
median per-round throughput ratio.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

from jaxserve.bench import plots
from jaxserve.bench.args import add_arrivals, add_common, add_dataset, parse_rates, set_command
from jaxserve.bench.backends import parse_backends
from jaxserve.bench.repeats import format_repeat_summary, repeat_summary, run_interleaved
from jaxserve.bench.session import Session, log
from jaxserve.bench.workloads import (
    LengthRange, Workload, edit_workload, random_workload, shared_prefix_workload, sharegpt_workload, warmup_requests,
    with_arrivals, with_temperature,
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("throughput", help="offline or rate-limited throughput, backends side by side",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "jaxserve,hf")
    add_dataset(p, num_prompts=32, input_len="32:512", output_len="16:256")
    add_arrivals(p)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds in which every backend runs the workload in turn (all backends stay "
                        "loaded); the summary gives medians and the median per-round throughput ratio")
    set_command(p, run)


def build_workload(session: Session, seed: int | None = None) -> Workload:
    a = session.args
    tok = session.tokenizer
    seed = a.seed if seed is None else seed
    return with_temperature(_greedy_workload(session, seed), a.temperature)


def _greedy_workload(session: Session, seed: int) -> Workload:
    a = session.args
    tok = session.tokenizer
    if a.dataset == "random":
        return random_workload(tok, a.num_prompts, LengthRange.parse(a.input_len, a.range_ratio),
                               LengthRange.parse(a.output_len, a.range_ratio), seed=seed)
    if a.dataset == "edit":
        return edit_workload(tok, a.num_prompts, seed=seed)
    if a.dataset == "sharegpt":
        if not a.dataset_path:
            raise SystemExit("--dataset sharegpt needs --dataset-path FILE.json (a local ShareGPT file)")
        return sharegpt_workload(tok, a.dataset_path, a.num_prompts, seed, a.sharegpt_output_len)
    return shared_prefix_workload(tok, a.num_groups, a.prompts_per_group, a.system_prompt_len,
                                  a.question_len, a.answer_len, seed)


def rate_workloads(session: Session, rates: list[float]) -> list[Workload]:
    """One workload per rate, the same for every backend. Each rate gets its own prompts (seed + i):
    a backend serves all rates in turn, and repeated prompts would be answered from its prefix cache."""
    a = session.args
    out = []
    for i, rate in enumerate(rates):
        wl = with_arrivals(build_workload(session, a.seed + i), rate, a.burstiness, a.seed + i)
        if len(rates) > 1:  # distinct ids too, so cross-backend comparisons pair the same prompts
            wl = replace(wl, requests=tuple(replace(r, request_id=f"{r.request_id}@{i}") for r in wl.requests))
        out.append(wl)
    return out


def _run_config(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    return {"request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency}


def run(args: argparse.Namespace) -> dict[str, Any]:
    session = Session(args, "throughput")
    names = parse_backends(args.backend)
    rates = parse_rates(args.request_rate)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and args.speculative_config:
        raise SystemExit("--repeats does not take --speculative-config yet (run without --repeats)")
    if args.repeats > 1 and len(rates) > 1:
        raise SystemExit("--repeats takes a single --request-rate (run a rate sweep again to repeat it)")
    workloads = rate_workloads(session, rates)
    base = workloads[0]
    warmup = warmup_requests(base, args.num_warmup)
    session.sized_for(*workloads)
    chosen = [plots.throughput_bars, plots.latency_cdfs] + ([plots.ttft_vs_rate] if len(rates) > 1 else [])
    if args.repeats > 1:
        rate = rates[0]
        runs = run_interleaved(session, names, base.requests, warmup,
                               session.options(not math.isinf(rate), args.max_concurrency),
                               _run_config(args, rate), args.repeats)
        summary = repeat_summary(runs)
        print(format_repeat_summary(summary))
        return session.finish(base, runs, extra={"repeats": summary}, plots=chosen)
    runs = []
    for name in names:
        backends = session.build_with_speculation(name)
        try:
            for backend in backends:
                if not session.warm(backend, warmup):
                    continue
                for rate, workload in zip(rates, workloads):
                    log(f"running {backend.label} at request rate {rate}")
                    r = session.run(backend, workload.requests,
                                    session.options(not math.isinf(rate), args.max_concurrency),
                                    _run_config(args, rate))
                    if r is not None:
                        if len(rates) > 1:
                            r.label = f"{r.label}@{'inf' if math.isinf(rate) else rate}"
                        runs.append(r)
        finally:
            for backend in backends:
                backend.close()
    return session.finish(base, runs, plots=chosen)
