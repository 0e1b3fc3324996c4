"""`jaxserve bench lora`: what serving LoRA adapters costs (docs/design.md, LoRA adapters).

- Throughput, output tokens/s, median of --repeats, side by side in one run: the same batch of
  --prompts requests on an engine without LoRA (the base model alone), on the LoRA engine with no
  adapter, and on the LoRA engine mixing --adapters adapters (request i under adapter i mod N).
  The runs alternate, so a neighbour's load on a shared machine falls on all of them alike.
- Adapter load time, median of --repeats: registering a new adapter (reading, checking and laying
  out its PEFT files: add_lora) and writing it into a device slot (the compiled writer, until
  the arrays are ready).

Adapters are random, in PEFT's file format, built from --seed in a temporary directory with the
model's shapes (lora/random_adapter.py): rank --rank on all seven projections. Nothing is read
from anywhere but the model.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from jaxserve.bench.args import set_command
from jaxserve.bench.session import log

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lora", help="multi-LoRA serving: a batch mixing adapters against the base model, "
                                    "adapter load time", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--adapters", type=int, default=4, help="adapters the mixed batch uses (one per request, in turn)")
    p.add_argument("--max-loras", type=int, default=4, help="device slots (>= --adapters: all resident)")
    p.add_argument("--rank", type=int, default=8, help="the random adapters' rank")
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="the slots' rank (default: --rank; a larger one measures the cost of padding)")
    p.add_argument("--prompts", type=int, default=16, help="requests per batch")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=128,
                   help="step token budget; the engines compile two buckets only (max-num-seqs decode rows, "
                        "alone and beside this budget's prefill tiles), which keeps start-up to minutes on a CPU")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each measurement (the median is reported)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the adapters' weights")
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--name", default=None)
    set_command(p, run)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(engines: dict[str, tuple[Any, list]], prompts: list[list[int]], output_len: int,
               repeats: int) -> dict[str, Any]:
    """engines: label -> (LLM, per-request LoRARequests or None); alternating timed runs."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)

    def batch(llm, loras):
        llm.engine.reset_prefix_cache()       # every run prefills every prompt
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras,
                            use_tqdm=False)

    for llm, loras in engines.values():      # untimed: every bucket and every slot load is done
        batch(llm, loras)
    times: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(repeats):
        for label, (llm, loras) in engines.items():
            times[label].append(_timed(lambda: batch(llm, loras)))
    tokens = len(prompts) * output_len
    out = {label: {"median_s": statistics.median(t), "tok_s": tokens / statistics.median(t), "runs_s": t}
           for label, t in times.items()}
    out["output_tokens"] = tokens
    return out


def load_times(llm, directory: str, targets, args) -> dict[str, float]:
    """Median seconds to register a new adapter (add_lora) and to write it into a slot."""
    import jax

    from jaxserve import LoRARequest
    from jaxserve.lora.random_adapter import write_random_adapter

    lora = llm.engine.lora
    register, write = [], []
    slot = 1
    for i in range(args.repeats):
        name = f"load-{i}"
        path = write_random_adapter(f"{directory}/{name}", targets, r=args.rank, alpha=2.0 * args.rank,
                                    target_modules=TARGETS, seed=args.seed + 1000 + i)
        req = LoRARequest(name, 1000 + i, path)
        register.append(_timed(lambda: llm.add_lora(req)))
        adapter = lora.registry.find(name)
        before = lora.device.resident.get(slot)
        t0 = time.perf_counter()
        llm.engine.runner.params = lora.device.write(llm.engine.runner.params, slot, adapter.key, adapter.values)
        jax.block_until_ready(llm.engine.runner.params)
        write.append(time.perf_counter() - t0)
        if before is not None:   # put back what the scheduler believes the slot holds
            held = lora.registry.by_key(before)
            llm.engine.runner.params = lora.device.write(llm.engine.runner.params, slot, before, held.values)
        llm.remove_lora(name)
    return {"register_s": statistics.median(register), "slot_write_s": statistics.median(write),
            "register_runs_s": register, "slot_write_runs_s": write}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import json
    import os

    from jaxserve import LLM, LoRARequest
    from jaxserve.lora.engine_lora import lora_targets
    from jaxserve.lora.random_adapter import write_random_adapter

    if args.max_lora_rank is None:
        args.max_lora_rank = args.rank
    if args.max_loras < args.adapters:
        raise SystemExit(f"--max-loras {args.max_loras} < --adapters {args.adapters}: the mixed batch would "
                         f"wait for slots, which this benchmark does not measure")
    tile = 16       # LLM's prefill tile
    common = dict(model=args.model, max_num_seqs=args.max_num_seqs, kv_cache_memory=256 << 20,
                  max_model_len=max(256, args.prompt_len + args.output_len + 16), prefill_tile=tile,
                  max_num_batched_tokens=args.max_num_batched_tokens, decode_buckets=(args.max_num_seqs,),
                  decode_only_buckets=(args.max_num_seqs,), prefill_buckets=(0, -(-args.max_num_batched_tokens // tile)))
    log("loading the engine without LoRA")
    base = LLM(**common)
    log("loading the engine with LoRA slots")
    llm = LLM(**common, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    targets = lora_targets(llm.engine.runner.model_config)
    rng = np.random.default_rng(args.seed)
    vocab = llm.engine.vocab_size
    prompts = [rng.integers(100, vocab - 1, args.prompt_len).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-lora-") as directory:
        adapters = [LoRARequest(f"adapter-{i}", i + 1,
                                write_random_adapter(f"{directory}/adapter-{i}", targets, r=args.rank,
                                                     alpha=2.0 * args.rank, target_modules=TARGETS,
                                                     seed=args.seed + i))
                    for i in range(args.adapters)]
        mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
        log(f"throughput: {args.prompts} requests x {args.output_len} tokens, {args.repeats} repeats")
        tput = throughput({"base_engine": (base, None), "lora_engine_no_adapter": (llm, None),
                           f"lora_engine_{args.adapters}_adapters": (llm, mixed)},
                          prompts, args.output_len, args.repeats)
        log("adapter load times")
        loads = load_times(llm, directory, targets, args)
    mixed_label = f"lora_engine_{args.adapters}_adapters"
    ratios = {"mixed_over_base_engine": tput[mixed_label]["tok_s"] / tput["base_engine"]["tok_s"],
              "no_adapter_over_base_engine": tput["lora_engine_no_adapter"]["tok_s"] / tput["base_engine"]["tok_s"]}
    for label in ("base_engine", "lora_engine_no_adapter", mixed_label):
        print(f"{label}: {tput[label]['tok_s']:.1f} tok/s (median {tput[label]['median_s']:.2f} s)")
    print(f"mixed {args.adapters} adapters / base engine: x{ratios['mixed_over_base_engine']:.2f}; "
          f"LoRA engine without adapters / base engine: x{ratios['no_adapter_over_base_engine']:.2f}")
    print(f"adapter load: register {loads['register_s'] * 1e3:.1f} ms, slot write {loads['slot_write_s'] * 1e3:.1f} ms "
          f"(medians of {args.repeats})")
    result = {"subcommand": "lora", "args": {k: v for k, v in vars(args).items() if not callable(v)},
              "throughput": tput, "ratios": ratios, "load": loads,
              "compilations_after_warmup": {"base": base.stats().steps.num_compilations_after_warmup,
                                            "lora": llm.stats().steps.num_compilations_after_warmup}}
    os.makedirs(args.output_dir, exist_ok=True)
    stem = args.name or f"lora-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    path = os.path.join(args.output_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
    return result
