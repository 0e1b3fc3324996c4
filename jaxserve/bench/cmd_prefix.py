"""`jaxserve bench prefix`: the shared-prefix workload with jaxserve's prefix cache on and off.

Default (the prefix-caching issue): 8 groups x 8 prompts, a 1,024-token system prompt per group,
64-token questions, 64-token answers, all sent at once. Reports output throughput, mean/p99 TTFT
and the prefix hit rate per variant, the on/off ratios, and, for n parallel samples of one long
prompt, the peak KV blocks used against n independent requests (cache off).

With --kv-offload-gib G the two variants are instead the prefix cache with its host tier (G GiB
of host memory) against the device cache alone: size the device pool (--num-kv-blocks) below
the workload's prefixes to see what the tier gives (docs/benchmarks.md, "the host tier").
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from jaxserve.bench import plots
from jaxserve.bench.args import add_common, add_shared_prefix, set_command
from jaxserve.bench.backends import parse_backends
from jaxserve.bench.metrics import summarize
from jaxserve.bench.session import Session, log
from jaxserve.bench.workloads import TokenSource, shared_prefix_workload, warmup_requests


def add_parser(sub: Any) -> None:
    p = sub.add_parser("prefix", help="shared-prefix workload, prefix cache on against off",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "jaxserve")
    add_shared_prefix(p)
    p.add_argument("--parallel-samples", type=int, default=4, help="n of the parallel-sampling block count (0: skip)")
    p.add_argument("--parallel-prompt-len", type=int, default=1000)
    p.add_argument("--parallel-output-len", type=int, default=32)
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="compare the prefix cache with a host tier of this many GiB against the device cache alone")
    set_command(p, run)


def peak_blocks(llm: Any, prompt: list[int], params: list[Any]) -> int:
    """Peak KV blocks in use (total - free - evictable cached) while these requests run together."""
    from jaxserve.bench.backend_jaxserve import _stats_dict

    eng, peak = llm.engine, 0
    tag = f"blocks-{time.monotonic_ns()}"
    for i, p in enumerate(params):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": list(prompt)}, p)
    while eng.has_unfinished_requests():
        eng.step()
        s = _stats_dict(llm)
        blocks = s["scheduler"]
        peak = max(peak, blocks["num_kv_blocks_total"] - blocks["num_kv_blocks_free"] - blocks["num_kv_blocks_cached"])
    return peak


def tier_stats(llm: Any) -> dict[str, Any]:
    """Where the engine's prefix hits came from (device, host tier) and what the tier moved."""
    s = llm.stats()
    out = {"device_hit_tokens": s.scheduler.prefix_cache_device_hits, "host_hit_tokens": s.scheduler.prefix_cache_host_hits,
           "host_bytes_loaded": s.kv.offload_bytes_loaded, "host_bytes_saved": s.kv.offload_bytes_saved,
           "preemptions": s.scheduler.num_preemptions}
    # the host pool's copy rate, as the engine measured it at start-up (runner/host_swap.py)
    calibration = getattr(llm.engine, "calibration", None)      # another engine's LLM has none
    cost = calibration.swap_cost if calibration is not None else None
    if cost is not None and cost.per_block_s > 0:
        out["host_copy_gb_s"] = s.kv.bytes_per_block / cost.per_block_s / 1e9
        out["host_copy_fixed_ms"] = cost.fixed_s * 1e3
    return out


def parallel_sampling_blocks(session: Session, backend: Any, cache_on: bool) -> dict[str, Any]:
    """n samples of one prompt with cache on, or n independent copies with it off."""
    from jaxserve.bench import backend_jaxserve as bj
    import numpy as np

    a = session.args
    prompt = list(TokenSource(session.tokenizer).window(np.random.default_rng(a.seed + 1), a.parallel_prompt_len))
    n, m = a.parallel_samples, a.parallel_output_len
    try:
        if cache_on:
            params = [bj.sampling_params(n=n, max_tokens=m, ignore_eos=True, temperature=0.8, seed=a.seed)]
        else:
            params = [bj.sampling_params(max_tokens=m, ignore_eos=True, temperature=0.8, seed=a.seed + i)
                      for i in range(n)]
        return {"peak_blocks": peak_blocks(backend.llm, prompt, params)}
    except (NotImplementedError, ValueError, TypeError) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def run(args: argparse.Namespace) -> dict[str, Any]:
    session = Session(args, "prefix")
    workload = shared_prefix_workload(session.tokenizer, args.num_groups, args.prompts_per_group,
                                      args.system_prompt_len, args.question_len, args.answer_len, args.seed)
    warmup = warmup_requests(workload, args.num_warmup)
    session.sized_for(workload)
    variants = []
    tier = args.kv_offload_gib > 0
    on_label, off_label = (("jaxserve[host-tier=on]", "jaxserve[host-tier=off]") if tier else
                           ("jaxserve[prefix-cache=on]", "jaxserve[prefix-cache=off]"))
    for name in parse_backends(args.backend):
        if name == "jaxserve" and tier:
            variants += [(name, on_label, {"enable_prefix_caching": True, "kv_offload_gib": args.kv_offload_gib}),
                         (name, off_label, {"enable_prefix_caching": True, "kv_offload_gib": 0.0})]
        elif name == "jaxserve":
            variants += [(name, on_label, {"enable_prefix_caching": True}),
                         (name, off_label, {"enable_prefix_caching": False})]
        else:
            variants.append((name, None, {}))
    runs, blocks, tiers = [], {}, {}
    for name, label, overrides in variants:
        backend = session.build(name, label, overrides)
        if backend is None:
            continue
        try:
            if not session.warm(backend, warmup):
                continue
            log(f"running {backend.label}")
            r = session.run(backend, workload.requests, session.options(), {"overrides": overrides})
            if r is not None:
                runs.append(r)
                if tier and getattr(backend, "llm", None) is not None:
                    tiers[backend.label] = tier_stats(backend.llm)
            if name == "jaxserve" and args.parallel_samples > 0 and not tier:
                key = "n_samples_cache_on" if overrides["enable_prefix_caching"] else "independent_cache_off"
                log(f"{backend.label}: KV blocks for {args.parallel_samples} samples ({key})")
                blocks[key] = parallel_sampling_blocks(session, backend, overrides["enable_prefix_caching"])
        finally:
            backend.close()
    table = {}
    for r in runs:
        m = summarize(r.records, r.duration_s)
        table[r.label] = {"ttft_mean_s": m.ttft.mean, "ttft_p99_s": m.ttft.p99, "output_tok_s": m.output_throughput,
                          "prefix_hit_rate": m.prefix_hit_rate, **tiers.get(r.label, {})}
    on, off = table.get(on_label), table.get(off_label)
    ratios = {}
    if on and off:
        ratios = {"ttft_mean_off_over_on": off["ttft_mean_s"] / on["ttft_mean_s"],
                  "throughput_on_over_off": on["output_tok_s"] / off["output_tok_s"]}
    extra = {"prefix_table": table, "ratios": ratios,
             "parallel_sampling": {"n": args.parallel_samples, "prompt_len": args.parallel_prompt_len, **blocks}}
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    if blocks:
        print(f"parallel sampling KV blocks: {blocks}")

    def ttft_bars(result: dict[str, Any], path: str) -> str:
        labels = list(table)
        return plots.grouped_bars("time to first token, prefix cache on/off", "seconds", labels,
                                  {"mean": [table[k]["ttft_mean_s"] for k in labels],
                                   "p99": [table[k]["ttft_p99_s"] for k in labels]}, path)

    return session.finish(workload, runs, extra=extra, plots=[plots.throughput_bars, plots.latency_cdfs, ttft_bars])
