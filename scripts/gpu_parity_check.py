"""Greedy parity on a GPU: the engine on the GPU attention kernels, the engine on the pure-JAX
reference attention and HF transformers, token for token, on one random-weight model.

The embedded GGUF does not travel to a GPU machine, so the model is built from a seed
(jaxserve.bench.random_model, default shape smollm2-135m: the embedded model's shape, head_dim
64, 3 query heads per KV head, 30 layers). Float32 throughout; what runs:
  1. HF transformers (torch, eager attention, TF32 off) greedy-decodes 2 candidate prompts per
     slot; each candidate's decisions are scored by their top-1 margin (float64 logits) over the
     float32 rounding error (float32 vs float64 logits on the same tokens), and each slot keeps
     the candidate with the larger smallest ratio, so no kept decision is a near-tie;
  2. the engine with attention_impl=IMPL (default "gpu": the dispatcher's choice, Mosaic GPU for
     16-bit caches on sm90+, the Triton kernel otherwise and for float32 everywhere) and
  3. the engine with attention_impl="reference"
generate the same prompts (token ids), exactly max_tokens each with ignore_eos (HF: no EOS id,
so EOS is an ordinary token on both sides). The engines run 8 seats, a 48-token step budget and
prompts of 6-85 tokens, so steps mix decodes with prefill chunks and long prompts are chunked;
both the decode-only and the mixed step shape run the kernel. One line per comparison, exact
token equality:

    parity impl=gpu vs hf: 8/8 identical
    parity impl=reference vs hf: 8/8 identical
    parity impl=gpu vs reference: 8/8 identical

Exit status 1 on any difference (or if the engine ran no Pallas kernel, or no mixed step), 2 on
bad usage or without a GPU (--device cuda).

Not bfloat16: a bf16 model rounds every activation to 8 bits (relative 4e-3), and the kernels
round softmax probabilities to bf16 before P.V where the reference keeps float32; the smallest
top-1 margins of 256 greedy decisions are about 1e-3 of the logit spread, so two correct bf16
implementations disagree on some token. scripts/gpu_kernel_check.py checks the bf16/f16 kernels
against tolerances instead.

Matmul precision: JAX lets a GPU run float32 dots as TF32 unless told otherwise. The model's own
matmuls and the attention implementations' float32 dots ask for HIGHEST (the Triton kernel's
jnp.dot included, whose Pallas lowering would otherwise pick TF32). --matmul-precision highest
also sets jax_default_matmul_precision, which reaches any dot that does not ask: if the default
run differs, that rerun tells TF32 rounding (about 1e4 times float32's) from a kernel bug.

Usage (a GPU machine; the checkout needs no install):
    python scripts/gpu_parity_check.py [--impl gpu] [--matmul-precision default|highest]
Dry run on a CPU (the Triton kernel in its interpreter, the tiny shape; 20 s on a busy 2-core
machine; without --shape tiny, the GPU run's model and settings: 2 minutes on one core):
    python scripts/gpu_parity_check.py --device cpu --impl triton_interpret --shape tiny
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (paragraph of jaxserve.bench.corpus.PARAGRAPHS, characters): slot i has two candidates of the
# same length from different paragraphs; 6 to 85 tokens with the random models' tokenizer.
CUTS = (12, 30, 50, 70, 90, 110, 130, 150)
SLOTS = tuple(((i, c), ((i + 3) % 8, c)) for i, c in enumerate(CUTS))

# 8 seats, 48-token steps in 16-row prefill tiles: the first steps are prefill-only, then new
# prompts' chunks join running decodes; the longest prompts take 2-3 chunks. Two step shapes:
# (8 decode rows, 0 tiles) and (8, 3). Blocks of 16 tokens suit both kernels.
ENGINE = dict(dtype="float32", max_num_seqs=8, max_model_len=160, block_size=16, prefill_tile=16,
              max_num_batched_tokens=48, num_kv_blocks=8 * 10 + 8, decode_buckets=(8,), prefill_buckets=(0, 3),
              long_prefill_token_threshold=0, preemption_mode="recompute", swap_space=0,
              compilation_cache_dir="", progress=False)
KERNEL_IMPLS = ("gpu", "mosaic", "triton", "mosaic_interpret", "triton_interpret")
ENV_DEFAULTS = (("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),   # torch shares the GPU with jax in this process
                ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                ("HF_HUB_DISABLE_PROGRESS_BARS", "1"))
NEAR_TIE = 10.0   # a kept decision whose margin is under this many rounding errors is reported


def say(msg: str) -> None:
    print(f"gpu_parity: {msg}", flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from jaxserve.bench.random_model import SHAPES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=KERNEL_IMPLS, default="gpu",
                   help="attention_impl checked against 'reference' (default gpu: the dispatcher's choice)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: a GPU run (jax on the GPU, HF on cuda); cpu: a dry run (needs an *_interpret impl)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="smollm2-135m")
    p.add_argument("--seed", type=int, default=0, help="weights' seed")
    p.add_argument("--num-prompts", type=int, default=len(SLOTS), choices=range(1, len(SLOTS) + 1),
                   metavar=f"1..{len(SLOTS)}")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--matmul-precision", choices=("default", "highest"), default="default",
                   help="highest: jax_default_matmul_precision=highest (no TF32 anywhere in the engine)")
    p.add_argument("--model-dir", help="build the model here (reused if it holds this build) instead of a temp dir")
    args = p.parse_args(argv)
    if args.device == "cpu" and not args.impl.endswith("_interpret"):
        p.error(f"--device cpu needs an interpreted kernel (mosaic_interpret, triton_interpret), not {args.impl!r}")
    if args.new_tokens < 1 or 90 + args.new_tokens > ENGINE["max_model_len"]:
        p.error(f"--new-tokens must be in 1..{ENGINE['max_model_len'] - 90}")
    return args


# -- HF transformers: the outside reference, and the choice of prompts ----------------------------
def hf_greedy(model_dir: str, candidates: list[list[list[int]]], new_tokens: int, device: str) -> list[dict]:
    """Per slot, the kept candidate: {ids, tokens, margins, error, ratio}. Float32 greedy decoding;
    margins (top-1 minus top-2) come from float64 logits on the same tokens, error is the largest
    |float32 - float64| logit over those positions."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    saved = (torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    if device == "cpu":
        torch.set_num_threads(1)   # the dry run's model is tiny: a thread pool only adds waiting on a busy machine
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False   # IEEE float32 on the GPU
    try:
        return _hf_greedy(model_dir, candidates, new_tokens, device)
    finally:   # as it was (the tests run this in-process)
        torch.set_num_threads(saved[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


def _hf_greedy(model_dir: str, candidates: list[list[list[int]]], new_tokens: int, device: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    def load(dtype):   # loaded as saved (float32), then cast: older transformers name the dtype argument differently
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        return model.to(device=device, dtype=dtype).eval()

    m32, m64 = load(torch.float32), load(torch.float64)
    # EOS is an ordinary token, as with the engine's ignore_eos: no stopping, no masking. (generate
    # fills a None in the config it is given from the model's own generation_config: clear it there.)
    m32.generation_config.eos_token_id = None
    greedy = copy.deepcopy(m32.generation_config)
    greedy.update(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=None,
                  pad_token_id=m32.config.pad_token_id or 0)
    kept = []
    with torch.no_grad():
        for slot in candidates:
            scored = []
            for ids in slot:
                x = torch.tensor([ids], device=device)
                seq = m32.generate(x, attention_mask=torch.ones_like(x), generation_config=greedy)
                tokens = seq[0, len(ids):].tolist()
                if len(tokens) != new_tokens:
                    raise RuntimeError(f"HF generated {len(tokens)} tokens, not {new_tokens}")
                rows = slice(len(ids) - 1, seq.shape[1] - 1)   # the logits each greedy choice was made from
                l64 = m64(seq).logits[0, rows]
                l32 = m32(seq).logits[0, rows].double()
                top = torch.topk(l64, 2, dim=-1)
                margins = (top.values[:, 0] - top.values[:, 1]).tolist()
                err = float((l32 - l64).abs().max())
                agree = top.indices[:, 0].tolist() == tokens   # float64 makes float32's choices
                ratio = min(margins) / max(err, 1e-30) if agree else 0.0
                scored.append(dict(ids=ids, tokens=tokens, margins=margins, error=err, ratio=ratio))
            kept.append(max(scored, key=lambda s: s["ratio"]))
    del m32, m64
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return kept


# -- the engine ----------------------------------------------------------------------------------
def picked_kernels(llm: Any, impl: str) -> set[str]:
    """What the dispatcher runs for the engine's step shapes (attention_impl=impl)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.dispatch import choose, resolve_implementation

    if impl == "reference":
        return {"reference"}
    # "gpu" hands the choice to the dispatcher (JAXSERVE_ATTENTION_IMPL, else the device's default)
    name = resolve_implementation(None if impl == "gpu" else impl)
    runner = llm.engine.runner
    spec, cfg = runner.arena_spec, runner.model_config
    k = jax.ShapeDtypeStruct(spec.layer_shape, jnp.dtype(spec.dtype))
    used = set()
    for rows in (ENGINE["decode_buckets"][-1],
                 ENGINE["decode_buckets"][-1] + ENGINE["prefill_buckets"][-1] * ENGINE["prefill_tile"]):
        q = jax.ShapeDtypeStruct((rows, cfg.num_attention_heads, cfg.head_dim), jnp.dtype(spec.dtype))
        used.add(choose(name, q, k)[0])
    return used


def run_engine(model_dir: str, impl: str, prompts: list[list[int]], new_tokens: int,
               engine: dict) -> tuple[list[list[int]], str]:
    from jaxserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model_dir, attention_impl=impl, **engine)
    t_start = time.perf_counter() - t0
    steps: Counter = Counter()
    runner = llm.engine.runner
    dispatch = runner.dispatch

    def counting(sched_out):
        decodes = sum(len(r.token_ids) == 1 for r in sched_out.requests)
        chunks = len(sched_out.requests) - decodes
        steps["mixed" if decodes and chunks else "prefill-only" if chunks else "decode-only"] += 1
        steps["partial"] += sum(len(r.token_ids) > 1 and not r.sample for r in sched_out.requests)
        return dispatch(sched_out)

    runner.dispatch = counting
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    t_gen = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    kernels = picked_kernels(llm, impl)
    s = llm.stats()
    del llm, runner, dispatch
    gc.collect()
    total = steps["mixed"] + steps["prefill-only"] + steps["decode-only"]
    say(f"engine impl={impl}: attention {'/'.join(sorted(kernels))}; {total} steps ({steps['prefill-only']} "
        f"prefill-only, {steps['mixed']} mixed, {steps['decode-only']} decode-only), {steps['partial']} partial "
        f"prefill chunks, {s.scheduler.num_preemptions} preemptions, {s.steps.num_compilations_after_warmup} compiles after "
        f"warm-up; start-up {t_start:.1f} s, generate {t_gen:.1f} s")
    problems = []
    if steps["mixed"] == 0 or steps["partial"] == 0:
        problems.append("no mixed prefill+decode step or no chunked prompt: the check does not cover them")
    if impl != "reference" and not kernels <= {"mosaic", "triton", "mosaic_interpret", "triton_interpret"}:
        problems.append(f"the dispatcher ran {sorted(kernels)}, not a Pallas kernel")
    return tokens, "; ".join(problems)


# -- comparing -----------------------------------------------------------------------------------
def compare(name_a: str, a: list[list[int]], name_b: str, b: list[list[int]], hf: list[dict] | None) -> bool:
    """Prints `parity impl=A vs B: n/N identical`, then per difference where it starts and, when
    HF took the same path up to there, HF's margin at that decision."""
    same = sum(x == y for x, y in zip(a, b))
    print(f"parity impl={name_a} vs {name_b}: {same}/{len(a)} identical", flush=True)
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        j = next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        ref = hf[i] if hf is not None else None
        where = ""
        if ref is not None and ref["tokens"][:j] == x[:j] and j < len(ref["margins"]):
            where = (f"; HF's top-1 margin there {ref['margins'][j]:.2e} logits = "
                     f"{ref['margins'][j] / max(ref['error'], 1e-30):.0f}x its fp32 rounding error")
        print(f"  prompt {i}: first difference at output token {j}: "
              f"{name_a} {x[j:j + 4]} vs {name_b} {y[j:j + 4]}{where}", flush=True)
    return same == len(a)


def main(argv: Sequence[str] | None = None) -> int:
    for var, value in ENV_DEFAULTS:
        os.environ.setdefault(var, value)
    # without `pip install -e .`: jaxserve.sched and jaxserve.checkpoints live in sched/ and checkpoints/
    if ROOT not in sys.path:
        sys.path.append(ROOT)
    from jaxserve.bench.run_from_checkout import map_packages

    map_packages(ROOT)
    args = parse_args(argv)
    t_all = time.perf_counter()

    import jax

    from jaxserve.bench import random_model
    from jaxserve.bench.corpus import PARAGRAPHS
    from pallas_kernels.dispatch import default_implementation

    backend = jax.default_backend()
    if args.device == "cuda":
        import torch

        if backend != "gpu" or not torch.cuda.is_available():
            say(f"no GPU (jax backend {backend!r}, torch cuda {torch.cuda.is_available()}); for a dry run on the "
                f"CPU: --device cpu --impl triton_interpret --shape tiny")
            return 2
    if args.matmul_precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    dev = jax.devices()[0]
    say(f"jax {jax.__version__} on {dev.device_kind} ({backend}); dispatcher default for this device "
        f"{default_implementation(dev)}; matmul precision {args.matmul_precision}; HF on {args.device}")

    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.mkdtemp(prefix="jaxserve-parity-")
        model_dir = os.path.join(tmp, args.shape)
    try:
        t0 = time.perf_counter()
        if random_model.main([model_dir, "--shape", args.shape, "--seed", str(args.seed)]) != 0:
            return 1
        say(f"model: random {args.shape}, seed {args.seed}, float32, in {model_dir} ({time.perf_counter() - t0:.1f} s)")

        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        slots = SLOTS[:args.num_prompts]
        candidates = [[tok(PARAGRAPHS[p][:c])["input_ids"] for p, c in slot] for slot in slots]
        t0 = time.perf_counter()
        ok = True
        try:
            hf = hf_greedy(model_dir, candidates, args.new_tokens, args.device)
        except Exception as e:   # the engines' own comparison needs no HF: run it anyway
            traceback.print_exc(file=sys.stderr)
            say(f"FAIL hf: {type(e).__name__}: {str(e)[:300]}; the engines run each slot's first candidate")
            ok, hf = False, None
        if hf is not None:
            worst = min(hf, key=lambda h: h["ratio"])
            say(f"hf: float32 greedy, eager attention ({time.perf_counter() - t0:.1f} s); prompts of "
                f"{', '.join(str(len(h['ids'])) for h in hf)} tokens x {args.new_tokens}; smallest top-1 margin "
                f"{min(min(h['margins']) for h in hf):.2e} logits, fp32 rounding error <= "
                f"{max(h['error'] for h in hf):.1e}, worst margin/error {worst['ratio']:.0f}x")
            if worst["ratio"] < NEAR_TIE:
                say(f"warning: a kept prompt has a greedy decision within {NEAR_TIE:.0f}x its fp32 rounding error "
                    f"of a tie; a difference there may be rounding, not a bug")
        prompts = [h["ids"] for h in hf] if hf is not None else [slot[0] for slot in candidates]

        engine = dict(ENGINE)
        if args.device == "cpu":
            engine["xla_optimization_level"] = 0   # half the compile time on the CPU
        results = {}
        for impl in (args.impl, "reference"):
            tokens, problem = run_engine(model_dir, impl, prompts, args.new_tokens, engine)
            if problem:
                say(f"FAIL impl={impl}: {problem}")
                ok = False
            if hf is not None:
                ok &= compare(impl, tokens, "hf", [h["tokens"] for h in hf], hf)
            results[impl] = tokens
        ok &= compare(args.impl, results[args.impl], "reference", results["reference"], hf)
        say(f"{'PASS' if ok else 'FAIL'} in {time.perf_counter() - t_all:.0f} s")
        return 0 if ok else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
