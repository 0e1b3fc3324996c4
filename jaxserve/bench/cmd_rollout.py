"""`jaxserve bench rollout`: what an RL loop asks of the engine (docs/rl.md), on one engine.

- Weight update time, median of --repeats: a pytree already on the engine's shardings (the
  in-process trainer's case: no copy), a host (numpy) pytree (device_put), the checkpoint's
  HF-named tensors (the host conversion at load, then device_put), and with
  --tensor-parallel-size > 1 a pytree on one device, resharded onto the mesh.
- Rollout throughput: --prompts prompts x n samples as one request each with n (the samples
  share the prompt's KV blocks) against n separate requests per prompt, output tokens/s,
  median of --repeats, ratio side by side in one run.
- With --batch-invariant: a second engine in the batch-invariant mode (docs/rl.md), its n-sample
  rollout throughput beside the default engine's, and for both the rollout-vs-replay gap: max
  |delta| between each sampled token's logprob and `reference_logprobs` of the same sequence,
  compiled with the engine's compiler options (it must read 0 in the mode).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from jaxserve.bench.args import set_command
from jaxserve.bench.session import log


def add_parser(sub: Any) -> None:
    p = sub.add_parser("rollout", help="RL rollouts: weight update time, n samples per prompt against separate requests",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2 GGUF)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of each measurement (the median is reported)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout batch")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--batch-invariant", action="store_true",
                   help="also run a batch-invariant engine: its rollout throughput and both engines' replay gap")
    p.add_argument("--output-dir", default="bench_results")
    p.add_argument("--name", default=None)
    set_command(p, run)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def update_times(llm, tensors: dict, repeats: int) -> dict[str, float]:
    import jax

    runner = llm.engine.runner
    placed = runner.params
    host = jax.tree.map(np.asarray, placed)
    out = {"same_shardings_s": _median_s(lambda: llm.update_weights(placed), repeats),
           "host_pytree_s": _median_s(lambda: llm.update_weights(host), repeats),
           "named_tensors_s": _median_s(lambda: llm.update_weights(tensors.items()), repeats)}
    if runner.mesh is not None:
        one = jax.devices()[0]
        elsewhere = jax.tree.map(lambda x: jax.device_put(x, one), placed)
        out["resharded_from_one_device_s"] = _median_s(lambda: llm.update_weights(elsewhere), repeats)
    llm.update_weights(placed)
    return out


def rollout_throughput(llm, prompts: list[list[int]], n: int, output_len: int, repeats: int) -> dict[str, Any]:
    from jaxserve import SamplingParams

    def shared():
        ps = SamplingParams(n=n, max_tokens=output_len, temperature=1.0, ignore_eos=True, seed=1)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)

    def separate():
        reqs = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]
        ps = [SamplingParams(max_tokens=output_len, temperature=1.0, ignore_eos=True, seed=1 + i)
              for i in range(len(reqs))]
        return llm.generate(reqs, ps, use_tqdm=False)

    tokens = len(prompts) * n * output_len
    shared(), separate()      # untimed: every bucket either needs is loaded
    # separate requests would hit the prefix cache on the prompts the n-sample run cached: flush
    # it before each run, so both prefill each prompt once per run at most
    def timed(fn):
        llm.engine.reset_prefix_cache()
        return fn()
    t_shared = _median_s(lambda: timed(shared), repeats)
    t_separate = _median_s(lambda: timed(separate), repeats)
    return {"n": n, "prompts": len(prompts), "output_tokens": tokens,
            "n_samples_tok_s": tokens / t_shared, "separate_requests_tok_s": tokens / t_separate,
            "ratio_n_samples_over_separate": t_separate / t_shared}


def replay_gap(llm, prompts: list[list[int]], n: int, output_len: int) -> float:
    """Max |sampled logprob - reference_logprobs| over one n-sample rollout of the prompts: the
    replay of each sequence alone, compiled with the engine's compiler options (a vmapped replay
    batches its dots, another program)."""
    import jax
    import jax.numpy as jnp

    from jaxserve import SamplingParams, reference_logprobs

    llm.engine.reset_prefix_cache()
    ps = SamplingParams(n=n, max_tokens=output_len, temperature=1.0, ignore_eos=True, seed=3, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
    runner = llm.engine.runner
    compiled = {}
    gap = 0.0
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            ids = jnp.asarray(prompt + list(c.token_ids), jnp.int32)
            if ids.shape[0] not in compiled:
                lowered = jax.jit(lambda p, ids: reference_logprobs(llm, p, ids)).lower(runner.params, ids)
                compiled[ids.shape[0]] = lowered.compile(runner.compiler_options)
            replay = np.asarray(compiled[ids.shape[0]](runner.params, ids))[len(prompt) - 1:]
            sampled = np.array([e[t].logprob for e, t in zip(c.logprobs, c.token_ids)], np.float32)
            gap = max(gap, float(np.abs(replay - sampled).max()))
    return gap


def invariance(llm, engine_kwargs: dict, prompts: list[list[int]], n: int, output_len: int,
               repeats: int, default_tok_s: float) -> dict[str, Any]:
    """The batch-invariant mode beside the default engine: rollout throughput and replay gaps."""
    from jaxserve import LLM

    default_gap = replay_gap(llm, prompts, n, output_len)
    log("loading the batch-invariant engine")
    invariant = LLM(**engine_kwargs, batch_invariant=True)
    tok_s = rollout_throughput(invariant, prompts, n, output_len, repeats)["n_samples_tok_s"]
    return {"default_tok_s": default_tok_s, "batch_invariant_tok_s": tok_s,
            "throughput_ratio_invariant_over_default": tok_s / default_tok_s,
            "default_replay_gap": default_gap,
            "batch_invariant_replay_gap": replay_gap(invariant, prompts, n, output_len),
            "batch_invariant_compilations_after_warmup": invariant.stats().steps.num_compilations_after_warmup}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import json
    import os

    from jaxserve import LLM
    from jaxserve.checkpoints.loader import load_checkpoint

    log("loading the engine")
    engine_kwargs = dict(model=args.model, max_num_seqs=args.max_num_seqs,
                         tensor_parallel_size=args.tensor_parallel_size,
                         max_model_len=max(512, args.prompt_len + args.output_len + 16))
    llm = LLM(**engine_kwargs)
    tensors = dict(load_checkpoint(args.model).tensors)
    log(f"timing weight updates ({args.repeats} repeats each)")
    updates = update_times(llm, tensors, args.repeats)
    for k, v in updates.items():
        print(f"update {k}: {v * 1e3:.1f} ms")
    rng = np.random.default_rng(0)
    vocab = llm.engine.vocab_size
    prompts = [rng.integers(100, vocab - 1, args.prompt_len).tolist() for _ in range(args.prompts)]
    log(f"rollouts: {args.prompts} prompts x n={args.n}, {args.output_len} tokens each")
    rollout = rollout_throughput(llm, prompts, args.n, args.output_len, args.repeats)
    print(f"rollout n={args.n}: {rollout['n_samples_tok_s']:.1f} tok/s shared prompt, "
          f"{rollout['separate_requests_tok_s']:.1f} tok/s separate requests "
          f"(x{rollout['ratio_n_samples_over_separate']:.2f})")
    extra = {}
    if args.batch_invariant:
        log("the batch-invariant mode beside the default")
        extra["batch_invariant"] = inv = invariance(llm, engine_kwargs, prompts, args.n, args.output_len,
                                                    args.repeats, rollout["n_samples_tok_s"])
        print(f"batch-invariant: {inv['batch_invariant_tok_s']:.1f} tok/s "
              f"(x{inv['throughput_ratio_invariant_over_default']:.2f} of the default); replay gap "
              f"{inv['batch_invariant_replay_gap']:.3g} (default engine: {inv['default_replay_gap']:.3g})")
    result = {"subcommand": "rollout", "args": {k: v for k, v in vars(args).items() if not callable(v)},
              "weight_update": updates, "rollout": rollout, "compilations_after_warmup":
              llm.stats().steps.num_compilations_after_warmup, **extra}
    os.makedirs(args.output_dir, exist_ok=True)
    stem = args.name or f"rollout-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    path = os.path.join(args.output_dir, stem + ".json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")
    return result
