"""The workload mixes of a goodput sweep (`jaxserve bench serve --workload chat|interference`).

- `chat`: the requests of `--dataset` (random by default: prompts of real text, lengths uniform
  over `--input-len` / `--output-len`; or a local ShareGPT file), labelled "chat".
- `interference`: the same chats, with a share (`--long-share`) of them replaced, at seeded random
  places in the stream, by long prompts (`--long-prompt-len` tokens, `--long-output-len` output
  tokens) labelled "long": chats decoding while long prompts prefill, as in `bench interference`,
  but arriving in one Poisson stream at the sweep's rate rather than on cue. Every request is
  judged by the same SLO; the report breaks attainment down by label.

Arrival times come later (workloads.with_arrivals), so one mix serves every rate of a sweep.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

import numpy as np

from jaxserve.bench.workloads import BenchRequest, TokenSource, Workload

MIXES = ("chat", "interference")


def add_mix_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload mix")
    g.add_argument("--workload", choices=MIXES, default="chat",
                   help="chat: the --dataset requests; interference: chats with a share replaced by long prompts")
    g.add_argument("--long-share", type=float, default=0.125, help="interference: share of requests that are long")
    g.add_argument("--long-prompt-len", type=int, default=2048, help="interference: tokens of a long prompt")
    g.add_argument("--long-output-len", type=int, default=8, help="interference: output tokens of a long prompt")


def check_mix_args(args: argparse.Namespace) -> None:
    if not 0 <= args.long_share < 1:
        raise SystemExit(f"--long-share must be in [0, 1), got {args.long_share}")
    if args.long_prompt_len < 1 or args.long_output_len < 1:
        raise SystemExit("--long-prompt-len and --long-output-len must be >= 1")


def chat_mix(chats: Workload) -> Workload:
    return Workload("chat", tuple(replace(r, group="chat") for r in chats.requests),
                    {"mix": "chat", "dataset": chats.name, **chats.params})


def interference_mix(chats: Workload, tokenizer: Any, long_share: float, long_prompt_len: int,
                     long_output_len: int, seed: int) -> Workload:
    """`chats` with round(long_share x n) of them, chosen by `seed`, replaced by long prompts."""
    if not 0 <= long_share < 1:
        raise ValueError(f"long_share must be in [0, 1), got {long_share}")
    rng = np.random.default_rng(seed)
    n = len(chats.requests)
    longs = set(rng.choice(n, size=round(long_share * n), replace=False).tolist())
    src = TokenSource(tokenizer)
    reqs: list[BenchRequest] = []
    for i, r in enumerate(chats.requests):
        if i in longs:
            reqs.append(BenchRequest(f"long-{i}", src.window(rng, long_prompt_len), long_output_len, group="long"))
        else:
            reqs.append(replace(r, group="chat"))
    return Workload("interference-mix", tuple(reqs), {
        "mix": "interference", "dataset": chats.name, **chats.params, "long_share": long_share,
        "num_long": len(longs), "long_prompt_len": long_prompt_len, "long_output_len": long_output_len})


def mix_workload(args: argparse.Namespace, chats: Workload, tokenizer: Any, seed: int) -> Workload:
    if args.workload == "chat":
        return chat_mix(chats)
    return interference_mix(chats, tokenizer, args.long_share, args.long_prompt_len, args.long_output_len, seed)
