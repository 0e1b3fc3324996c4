"""`jaxserve bench interference`: short chats decoding while long prompts arrive, per chunk size.

Default (the scheduling issue): 16 chats (64-token prompts, 128-token answers) sent at once;
once every chat has its first token, 4 prompts of 4,096 tokens arrive 0.5 s apart. Variants:
the chats alone (the ITL baseline), the serving default chunking (derived from an ITL budget at
start-up, engine/chunk_policy.py), each `--chunk-sizes` value as
`long_prefill_token_threshold`, and `none` = chunked prefill off. Each variant is a fresh engine
(the chunk size is an engine setting) driven by the step loop with timed arrivals.

Reported per variant: the chats' ITL p50/p99 and the long prompts' TTFT, and the targets:
default chunking keeps the chats' p99 ITL <= 2x the baseline p50 ITL (the requirement), and the
long prompts' TTFT within 1.5x of unchunked (reported against). `--repeats N` runs the pair
(chats alone, default) N times on the default engine: the ratio's spread on a shared machine is
wide, so every round's ratio is reported and the table shows the median round.
`--disaggregated` runs instead, in one run, a colocated server on both `--cpu-sets` against a
prefill server on the first and a decode server on the second behind the router
(disagg_interference.py).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from jaxserve.bench import plots
from jaxserve.bench.args import add_common, engine_kwargs, set_command
from jaxserve.bench.metrics import LatencyStats
from jaxserve.bench.session import Session, log
from jaxserve.bench.workloads import interference_workload, warmup_requests
from jaxserve.engine_args import default_arg


def add_parser(sub: Any) -> None:
    p = sub.add_parser("interference", help="chat inter-token latency while long prompts prefill",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common(p, "jaxserve")
    p.add_argument("--num-chats", type=int, default=16)
    p.add_argument("--chat-prompt-len", type=int, default=64)
    p.add_argument("--chat-output-len", type=int, default=128)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--long-prompt-len", type=int, default=4096)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=0.5, help="seconds between long prompts")
    p.add_argument("--chunk-sizes", default="64,256,1024,none",
                   help="long_prefill_token_threshold values; 'none' = chunked prefill off")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of (chats alone, default) on the default engine; the table and the ITL "
                        "target use the round with the median ratio, and every round's ratio is reported")
    d = p.add_argument_group("disaggregated prefill and decode (--disaggregated)")
    d.add_argument("--disaggregated", action="store_true",
                   help="servers instead of in-process engines: colocated on both CPU sets vs prefill on the first "
                        "and decode on the second, behind the router")
    d.add_argument("--cpu-sets", default="0:1", help="prefill:decode CPU sets (the colocated engine gets both)")
    d.add_argument("--prefill-threshold-tokens", type=int, default=256,
                   help="prompts shorter than this skip the prefill engine (the chats)")
    d.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="a `jaxserve serve` argument for every server, verbatim (repeatable; --serve-arg=--dtype=float32)")
    set_command(p, run)


def _variants(text: str, *, budget: int, num_chats: int, tile: int, max_model_len: int
              ) -> list[tuple[str, dict[str, Any]]]:
    """(label, engine overrides) per variant. A chunk of C tokens needs a step budget of C plus
    the chats' decodes, and "unchunked" one that holds the longest prompt whole, so those
    variants get their token budget raised (in whole tiles); the others keep `budget`."""
    def fitting(tokens: int) -> int:
        return max(budget, -(-tokens // tile) * tile)

    # "default" is the serving default (what the gRPC server runs): the chunk derived at start-up
    # from the ITL budget; LLM alone would default to no cap (offline batches).
    out: list[tuple[str, dict[str, Any]]] = [("default", {"long_prefill_token_threshold": None})]
    for t in (t.strip() for t in text.split(",") if t.strip()):
        if t == "none":
            out.append(("unchunked", {"enable_chunked_prefill": False,
                                      "max_num_batched_tokens": fitting(max_model_len)}))
        else:
            if int(t) < 1:
                raise ValueError(f"--chunk-sizes values must be >= 1 or 'none', got {t!r}")
            c = int(t)
            out.append((f"chunk={c}", {"long_prefill_token_threshold": c,
                                       "max_num_batched_tokens": fitting(c + num_chats)}))
    return out


def serving_prefill_tile(args: argparse.Namespace) -> int:
    """The server's prefill tile (LLM, which the benchmark drives, defaults to the offline one),
    unless --engine-arg sets it."""
    return int(engine_kwargs(args).get("prefill_tile", default_arg("prefill_tile")))


def row(records: list[Any]) -> dict[str, Any]:
    chats = [r for r in records if r.group == "chat"]
    longs = [r for r in records if r.group == "long"]
    itl = LatencyStats.of(x for r in chats for x in r.itls)
    ttft = LatencyStats.of(r.ttft for r in longs)
    return {"chat_itl_p50_s": itl.median, "chat_itl_p99_s": itl.p99, "chat_itl_mean_s": itl.mean,
            "long_ttft_mean_s": ttft.mean, "long_ttft_max_s": ttft.max}


def itl_ratio(base: dict[str, Any], default: dict[str, Any]) -> float:
    """The ITL target's measure: the default's p99 over the chats-alone p50."""
    return default["chat_itl_p99_s"] / base["chat_itl_p50_s"]


def median_round(rounds: dict[int, dict[str, dict[str, Any]]]) -> int | None:
    """The round (with both rows) whose ratio is the median, the lower middle for an even count;
    None if no round has both."""
    complete = sorted((itl_ratio(r["chats alone"], r["default"]), k) for k, r in rounds.items()
                      if "chats alone" in r and "default" in r)
    return complete[(len(complete) - 1) // 2][1] if complete else None


def table_median_round(rounds: dict[int, dict[str, dict[str, Any]]], table: dict[str, dict[str, Any]]
                       ) -> dict[str, Any]:
    """Puts the median round's rows in `table` (keeping its order); returns what the result's
    extra gets: every complete round's rows and ratio, and which round is the median."""
    mid = median_round(rounds)
    if mid is None:
        return {}
    table.update(rounds[mid])
    by_round = {str(k): {**r, "ratio": itl_ratio(r["chats alone"], r["default"])}
                for k, r in rounds.items() if "chats alone" in r and "default" in r}
    print("chats' p99 ITL / baseline p50 by round: "
          + ", ".join(f"{r['ratio']:.2f}" for r in by_round.values()) + f" (median: round {mid})")
    return {"rounds": by_round, "median_round": mid}


def targets(table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base, default, unchunked = table.get("chats alone"), table.get("default"), table.get("unchunked")
    out: dict[str, Any] = {}
    if base and default:
        ratio = itl_ratio(base, default)
        out["chat_p99_itl_over_baseline_p50"] = ratio
        out["itl_target_met (<= 2)"] = bool(ratio <= 2.0)
    if default and unchunked and unchunked["long_ttft_mean_s"]:
        ratio = default["long_ttft_mean_s"] / unchunked["long_ttft_mean_s"]
        out["long_ttft_over_unchunked"] = ratio
        out["ttft_target_met (<= 1.5)"] = bool(ratio <= 1.5)
    return out


def itl_bars(result: dict[str, Any], path: str) -> str:
    table = result["extra"]["interference_table"]
    labels = list(table)
    return plots.grouped_bars("chats' inter-token latency while long prompts prefill", "milliseconds", labels,
                              {"p50": [1e3 * table[k]["chat_itl_p50_s"] for k in labels],
                               "p99": [1e3 * table[k]["chat_itl_p99_s"] for k in labels]}, path)


def long_ttft_bars(result: dict[str, Any], path: str) -> str:
    table = result["extra"]["interference_table"]
    labels = [k for k in table if k != "chats alone"]
    return plots.grouped_bars("long prompts' time to first token", "seconds", labels,
                              {"mean": [table[k]["long_ttft_mean_s"] for k in labels],
                               "max": [table[k]["long_ttft_max_s"] for k in labels]}, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    session = Session(args, "interference")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.backend != "jaxserve":
        log("interference compares jaxserve engine settings; ignoring --backend other than jaxserve")
    workload = interference_workload(session.tokenizer, args.num_chats, args.chat_prompt_len, args.chat_output_len,
                                     args.num_long, args.long_prompt_len, args.long_output_len,
                                     args.long_interval, args.seed)
    # the baseline runs on the same engine as "default" just before it: other prompts (seed + 1),
    # so the default run's chats are not served from the prefix cache
    chats_only = interference_workload(session.tokenizer, args.num_chats, args.chat_prompt_len, args.chat_output_len,
                                       0, args.long_prompt_len, args.long_output_len, args.long_interval, args.seed + 1)
    base_overrides: dict[str, Any] = {}
    if args.max_model_len is None:  # the long prompts must fit; round up to a block multiple
        need = workload.summary()["max_seq_len"]
        base_overrides["max_model_len"] = -(-need // 256) * 256
    if args.disaggregated:
        from jaxserve.bench.disagg_interference import run_disaggregated

        serve_args = (["--model", args.model] if args.model else []) + [
            "--max-model-len", str(args.max_model_len or base_overrides["max_model_len"])] + list(args.serve_arg)
        return run_disaggregated(args, workload, chats_only, serve_args)
    warmup = warmup_requests(chats_only, args.num_warmup)
    session.sized_for(workload)
    runs, table = [], {}
    rounds: dict[int, dict[str, dict[str, Any]]] = {}   # round -> the default engine's rows
    # the server's defaults, where LLM's offline ones differ (prefill_tile)
    budget = args.max_num_batched_tokens or default_arg("max_num_batched_tokens")
    max_len = args.max_model_len or base_overrides["max_model_len"]
    tile = base_overrides["prefill_tile"] = serving_prefill_tile(args)
    variants = _variants(args.chunk_sizes, budget=budget, num_chats=args.num_chats, tile=tile,
                         max_model_len=max_len)
    for label, overrides in variants:
        backend = session.build("jaxserve", f"jaxserve[{label}]", {**base_overrides, **overrides})
        if backend is None:
            continue
        try:
            if not session.warm(backend, warmup):
                continue
            jobs = [("chats alone", chats_only)] if label == "default" else []
            jobs.append((label, workload))
            n_rounds = args.repeats if label == "default" else 1
            for k in range(1, n_rounds + 1):
                for name, wl in jobs:
                    tag = name.replace(" ", "-") + (f"-{k}" if n_rounds > 1 else "")
                    log(f"running {name}" + (f", round {k}/{n_rounds}" if n_rounds > 1 else ""))
                    reqs = [replace(r, request_id=f"{r.request_id}-{tag}") for r in wl.requests]
                    r = session.run(backend, reqs, session.options(timed_arrivals=True),
                                    {"variant": name, "round": k, **overrides})
                    if r is None:
                        continue
                    r.label = f"jaxserve[{name}]" + (f"#{k}" if n_rounds > 1 else "")
                    runs.append(r)
                    table[name] = rounds.setdefault(k, {})[name] = row(r.records)
        except ValueError as e:  # an engine that rejects a setting: record it, keep the other variants
            log(f"variant {label} failed: {e}")
            session.skipped.append({"backend": f"jaxserve[{label}]", "reason": str(e)})
        finally:
            backend.close()
    extra = table_median_round(rounds, table) if args.repeats > 1 else {}
    met = targets(table)
    print(f"{'variant':<14}{'chat ITL p50 ms':>16}{'chat ITL p99 ms':>16}{'long TTFT mean s':>18}")
    for name, t in table.items():
        f = lambda v, k: "n/a" if v is None or v != v else f"{v * k:.2f}"  # noqa: E731
        print(f"{name:<14}{f(t['chat_itl_p50_s'], 1e3):>16}{f(t['chat_itl_p99_s'], 1e3):>16}"
              f"{f(t['long_ttft_mean_s'], 1):>18}")
    for k, v in met.items():
        print(f"{k}: {v}")
    return session.finish(workload, runs, extra={"interference_table": table, "targets": met, **extra},
                          plots=[itl_bars, long_ttft_bars, plots.latency_cdfs])
