"""A CPU decode step of the embedded model: the operations (thunks) its executable runs and its
time per token, for a quantization mode, with the native CPU kernels on (the engine's default)
or off (JAXSERVE_CPU_KERNELS=0 in the environment).

Thunks: the entry computation's operations of each decode bucket's step (jaxserve/bench/hlo_ops.py).
Time per token: an engine of `--batch` requests generating 1 token and `1 + --tokens` tokens
(256-token prompts, greedy, EOS ignored), the difference over `--tokens`, the median of `--repeats`
pairs: a steady decode step with the prompt's prefill taken out.

  python scripts/step_ops.py --quantization w8a8 --quantize-lm-head --batch 1,8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantization", default="w8a8")
    p.add_argument("--quantize-lm-head", action="store_true")
    p.add_argument("--batch", default="1,8", help="decode batch sizes (each a decode bucket)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output-json")
    args = p.parse_args(argv)

    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.hlo_ops import body_ops, entry_ops

    batches = [int(b) for b in args.batch.split(",")]
    extra = {"quantize_lm_head": True} if args.quantize_lm_head else {}
    llm = LLM(quantization=args.quantization, max_num_seqs=max(batches), decode_buckets=tuple(batches),
              max_model_len=1024, warm_up="all", progress=False, **extra)
    runner = llm.engine.runner
    rng = np.random.default_rng(0)
    results = []
    for batch in batches:
        step, _ = runner.step_and_sampler((batch, 0))
        text = step.as_text()
        ops, loop_ops = entry_ops(text), body_ops(text)

        def run(tokens: int) -> float:
            prompts = [{"prompt_token_ids": rng.integers(100, 40000, args.prompt_len).tolist()} for _ in range(batch)]
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t0

        run(1 + args.tokens)                                  # warm every path once
        tpot = []
        for _ in range(args.repeats):
            one, many = run(1), run(1 + args.tokens)
            tpot.append((many - one) / args.tokens * 1e3)
        results.append({"batch": batch, "thunks": sum(ops.values()), "by_kind": dict(ops.most_common()),
                        "loop_body_thunks": sum(loop_ops.values()), "tpot_ms": statistics.median(tpot),
                        "tpot_ms_all": tpot})
        r = results[-1]
        print(f"batch {batch:2d}: {r['thunks']:4d} thunks ({', '.join(f'{k} {v}' for k, v in ops.most_common(5))}), "
              f"+{r['loop_body_thunks']} per loop iteration; TPOT {r['tpot_ms']:.2f} ms "
              f"({', '.join(f'{t:.2f}' for t in tpot)})", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"command": "scripts/step_ops.py", "args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
