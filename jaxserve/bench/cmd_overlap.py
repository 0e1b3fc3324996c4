"""`jaxserve bench overlap`: decode throughput with the one-step-ahead loop on and off.

The loop pays off where a step's host work (scheduling, packing, detokenizing, outputs) is a large
share of the step: a small model, many sequences. The default is the random `small` model (6
layers, hidden 256), where a decode step of 32 sequences takes a few milliseconds on our CPU, about
what the host spends on it (`--shape tiny`, 2 layers, hidden 64, leaves the device idle most of a
step: there is little to overlap), and a decode-heavy workload: `--num-requests` prompts of
`--input-len` random tokens, exactly `--output-len` greedy output tokens each (EOS ignored), all
sent at once. Both loops run on one compiled runner (the
second engine shares the first's executables), in turn for `--rounds` rounds, each round on fresh
engines; the result gives each round's output tok/s, host ms per step and device idle share, the
median ratio, and whether both loops produced the same tokens.
"""

from __future__ import annotations

import argparse
import datetime
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("overlap", help="decode throughput with the one-step-ahead loop on and off",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory or GGUF; default: a random model of --shape")
    p.add_argument("--shape", default="small", help="random model shape when --model is not given")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="on/off pairs run in turn; medians are reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--name", default=None, help="file stem of the JSON result (default: overlap-UTC-TIMESTAMP)")
    p.add_argument("--no-progress", action="store_true")
    set_command(p, run)


def _check(args: argparse.Namespace) -> None:
    for name in ("num_requests", "input_len", "output_len", "max_num_seqs", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"jaxserve bench overlap: --{name.replace('_', '-')} must be >= 1")


def _one_round(llm, prompts, params) -> dict[str, Any]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - t
    s = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"duration_s": duration, "output_tokens": tokens, "output_tok_s": tokens / duration,
            "host_ms_per_step": s.steps.host_ms_per_step, "device_idle_fraction": s.steps.device_idle_fraction,
            "num_compilations_after_warmup": s.steps.num_compilations_after_warmup,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.random_model import make_random_hf_model

    _check(args)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model = args.model
    tmp = None
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="jaxserve-overlap-")
        model = make_random_hf_model(os.path.join(tmp.name, args.shape), args.shape, seed=args.seed)
    max_len = args.input_len + args.output_len
    engine_args = dict(max_num_seqs=args.max_num_seqs, max_model_len=max(max_len, 64), dtype="float32",
                       progress=not args.no_progress)
    log(f"building the engine ({args.shape if args.model is None else model})")
    base = LLM(model, **engine_args)
    vocab = base.engine.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()} for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len, temperature=0.0,
                             ignore_eos=True)] * args.num_requests
    base.generate(prompts[:2], params[:2], use_tqdm=False)   # warm the host-side paths too
    rounds = []
    for i in range(args.rounds):
        row = {}
        for label, on in (("on", True), ("off", False)):
            llm = LLM.sharing_runner(base, async_scheduling=on)
            row[label] = _one_round(llm, prompts, params)
        row["ratio"] = row["on"]["output_tok_s"] / row["off"]["output_tok_s"]
        row["same_tokens"] = row["on"].pop("token_ids") == row["off"].pop("token_ids")
        log(f"round {i + 1}: on {row['on']['output_tok_s']:.0f} tok/s "
            f"(host {row['on']['host_ms_per_step']:.2f} ms/step, idle {row['on']['device_idle_fraction']:.0%}), "
            f"off {row['off']['output_tok_s']:.0f} tok/s (host {row['off']['host_ms_per_step']:.2f} ms/step, "
            f"idle {row['off']['device_idle_fraction']:.0%}): {row['ratio']:.2f}x, same tokens: {row['same_tokens']}")
        rounds.append(row)
    if tmp is not None:
        tmp.cleanup()

    def median(label, key):
        return statistics.median(r[label][key] for r in rounds)

    summary = {
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "all_same_tokens": all(r["same_tokens"] for r in rounds),
        **{f"{label}_{key}": median(label, key) for label in ("on", "off")
           for key in ("output_tok_s", "host_ms_per_step", "device_idle_fraction")},
    }
    result = {
        "subcommand": "overlap",
        "created_utc": started,
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "bench_run")},
        "environment": environment(),
        "rounds": rounds,
        "summary": summary,
    }
    path = write_result(result, args.output_dir, args.name)
    print(f"one-step-ahead loop on / off: median {summary['median_ratio']:.2f}x over {args.rounds} rounds "
          f"(on {summary['on_output_tok_s']:.0f} tok/s, host {summary['on_host_ms_per_step']:.2f} ms/step, "
          f"device idle {summary['on_device_idle_fraction']:.0%}; off {summary['off_output_tok_s']:.0f} tok/s, "
          f"host {summary['off_host_ms_per_step']:.2f} ms/step, device idle {summary['off_device_idle_fraction']:.0%}); "
          f"same tokens: {summary['all_same_tokens']}; {path}")
    return result
