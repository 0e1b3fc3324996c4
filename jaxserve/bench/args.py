"""Command-line options shared by the `jaxserve bench` subcommands, and their translation.

Engine flags mirror `EngineConfig` fields (`--max-num-seqs` <-> `max_num_seqs`); only flags the
user sets are passed, so every other field keeps the engine's own default. `--engine-arg K=V`
passes any other field.
"""

from __future__ import annotations

import argparse
import ast
import math
from typing import Any, Callable

from jaxserve.bench.arrivals import parse_rate

_ENGINE_INT_FLAGS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks",
                     "block_size", "long_prefill_token_threshold")


def add_common(p: argparse.ArgumentParser, default_backends: str) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--model", default=None,
                   help="GGUF file or HF directory fed to every backend (default: the embedded SmolLM2 GGUF)")
    g.add_argument("--backend", default=default_backends,
                   help=f"comma-separated backends run one after the other: jaxserve, hf, hf-compiled, hf-cb, vllm, "
                        f"llamacpp, esurge (EasyDeL, in its own venv: bash scripts/esurge/setup.sh) "
                        f"(default: {default_backends})")
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and arrival times")
    g.add_argument("--output-dir", default="bench_results", help="where the JSON result and PNG plots go")
    g.add_argument("--name", default=None, help="file stem of the result (default: SUBCOMMAND-UTC-TIMESTAMP)")
    g.add_argument("--num-warmup", type=int, default=1, help="untimed requests sent to each backend first")
    g.add_argument("--no-plots", action="store_true", help="write no PNG files")
    g.add_argument("--no-progress", action="store_true", help="no progress bars (requests, and jaxserve's compiling and warm-up)")

    e = p.add_argument_group("jaxserve engine (unset flags keep the engine's defaults)")
    e.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"),
                   help="weights and activations of every backend (auto: float32 on CPU, bfloat16 on GPU)")
    for name in _ENGINE_INT_FLAGS:
        e.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\': the jaxserve '
                        'backend then runs twice on one compiled runner, without ("jaxserve") and with it '
                        '("jaxserve+spec")')
    e.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other EngineConfig field, value as a Python literal (repeatable)")
    e.add_argument("--jaxserve-api", choices=("auto", "generate", "engine"), default="auto",
                   help="generate: LLM.generate; engine: the step loop (KV trace); auto: generate unless "
                        "arrivals are timed or concurrency is capped")

    h = p.add_argument_group("PyTorch path")
    h.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf backend")
    h.add_argument("--hf-cb-max-requests", type=int, default=16, help="hf-cb: max requests per batch")
    h.add_argument("--hf-cb-max-batch-tokens", type=int, default=512, help="hf-cb: token budget per step")


def add_arrivals(p: argparse.ArgumentParser, rate_help: str = "requests/s (comma-separated for a sweep)") -> None:
    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", default="inf", help=f"{rate_help}; inf sends everything at once")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")


def add_dataset(p: argparse.ArgumentParser, num_prompts: int, input_len: str, output_len: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "sharegpt", "shared-prefix", "edit"), default="random",
                   help="edit: correct and write out a given text (repetitive output, as editing or summarising)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sample every request at this temperature, seeded per request (0: greedy; jaxserve only)")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", default=input_len, help="random: LOW:HIGH, or N widened by --range-ratio")
    g.add_argument("--output-len", default=output_len, help="random: LOW:HIGH, or N widened by --range-ratio")
    g.add_argument("--range-ratio", type=float, default=0.0)
    g.add_argument("--dataset-path", default=None, help="sharegpt: a local JSON file in ShareGPT format")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: fixed output length")
    add_shared_prefix(p, g)


def add_shared_prefix(p: argparse.ArgumentParser, group: Any = None) -> None:
    g = group or p.add_argument_group("shared-prefix workload")
    g.add_argument("--num-groups", type=int, default=8)
    g.add_argument("--prompts-per-group", type=int, default=8)
    g.add_argument("--system-prompt-len", type=int, default=1024)
    g.add_argument("--question-len", type=int, default=64)
    g.add_argument("--answer-len", type=int, default=64, help="shared-prefix: output tokens per prompt")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {"dtype": args.dtype}
    for name in _ENGINE_INT_FLAGS:
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if getattr(args, "enable_prefix_caching", None) is not None:
        kw["enable_prefix_caching"] = args.enable_prefix_caching
    for item in getattr(args, "engine_arg", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-arg expects KEY=VALUE, got {item!r}")
        try:
            kw[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kw[key] = value  # a bare word is a string
    return kw


def parse_rates(text: str) -> list[float]:
    return [parse_rate(t.strip()) for t in str(text).split(",") if t.strip()]


def jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        if callable(v):
            continue
        out[k] = "inf" if isinstance(v, float) and math.isinf(v) else v
    return out


def set_command(p: argparse.ArgumentParser, run: Callable[[argparse.Namespace], Any]) -> None:
    """`func` is what jaxserve's CLI calls (its return value is the exit status, so 0);
    `bench_run` returns the result itself, for Python callers and tests."""
    def func(args: argparse.Namespace) -> int:
        run(args)
        return 0

    p.set_defaults(func=func, bench_run=run)
