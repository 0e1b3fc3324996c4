"""`jaxserve bench host --without-model`: the scheduler's and the persistent batch's share of a
decode step alone, with no model, no device and no engine, by batch size and context length.

With a model, a long context makes the device's step long and (on a CPU) its KV reads evict the
caches the host's work runs from, so `bench host` cannot tell the host path's own growth with
context from the machine's. Here B requests of `--input-len` random prompt tokens are scheduled
to the end of their prefill, then every decode step is timed in three parts: `schedule`
(Scheduler.schedule), `pack` (PersistentBatch.pack, the runner's arrays) and `update`
(Scheduler.update with one token per request); medians over `--steps` steps per round, and over
rounds. Prefix caching is on (as in the engine), block size 16.

It imports only jaxserve.sched and the runner's persistent batch, so it also runs against an
older tree: copy this file into that tree's jaxserve/bench/ and run
`python -m jaxserve.bench.run_from_checkout --checkout DIR jaxserve.bench.host_without_model ...`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

PARTS = ("schedule", "pack", "update")
BLOCK_SIZE = 16
TOKEN_BUDGET = 16384
WARM_STEPS = 5     # decode steps not timed: the persistent batch seats every request in the first


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,16,64,256", help="running requests, comma-separated")
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)


def one_round(batch: int, input_len: int, steps: int, seed: int) -> dict[str, float]:
    """Medians (ms) of each part over `steps` decode steps of `batch` requests."""
    from jaxserve.runner.buckets import RunnerShapes
    from jaxserve.runner.persistent_batch import PersistentBatch
    from jaxserve.sched import Scheduler, SchedulerConfig
    from jaxserve.sched.request import Request

    # every request must still be decoding when the last prompt's prefill ends
    out_len = steps + WARM_STEPS + 4 + batch * input_len // TOKEN_BUDGET + 2
    max_len = input_len + out_len + 8
    max_len += -max_len % BLOCK_SIZE
    sched = Scheduler(SchedulerConfig(
        num_blocks=batch * (max_len // BLOCK_SIZE) * 5 // 4 + 16,   # room beyond admission's watermark
        block_size=BLOCK_SIZE, max_model_len=max_len,
        max_num_seqs=batch, max_num_batched_tokens=TOKEN_BUDGET, long_prefill_token_threshold=max_len,
        enable_prefix_caching=True))
    prompts = np.random.default_rng(seed).integers(3, 30000, (batch, input_len)).tolist()
    for i, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{i}", prompt, out_len, min_tokens=out_len, ignore_eos=True))
    shapes = RunnerShapes(block_size=BLOCK_SIZE, max_model_len=max_len, prefill_tile=16, decode_buckets=(batch,),
                          prefill_buckets=(0,), decode_only_buckets=(batch,))
    runner_batch = PersistentBatch(shapes, mask_words=0, seats=batch)
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    decoded = 0
    while decoded < steps + WARM_STEPS:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        decoding = len(out.requests) == batch and all(len(r.token_ids) == 1 for r in out.requests)
        if decoding:
            runner_batch.pack(out)
        t2 = time.perf_counter()
        sched.update(out, {r.request_id: (7,) for r in out.requests if r.sample})
        t3 = time.perf_counter()
        if not decoding:
            if not sched.has_unfinished_requests():
                raise SystemExit(f"host --without-model: batch {batch} never decoded all at once")
            continue
        decoded += 1
        if decoded > WARM_STEPS:
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2)):
                times[part].append(dt)
    return {f"{p}_ms": 1000 * statistics.median(v) for p, v in times.items()}


def measure(batches: list[int], input_len: int, steps: int, rounds: int, seed: int) -> dict[int, dict[str, Any]]:
    per_batch = {}
    for batch in batches:
        rs = [one_round(batch, input_len, steps, seed) for _ in range(rounds)]
        for r in rs:
            r["host_ms"] = sum(r[f"{p}_ms"] for p in PARTS)
        per_batch[batch] = {"rounds": rs, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
    return per_batch


def table(per_batch: dict[int, dict[str, Any]]) -> str:
    first = next(iter(per_batch.values()))["host_ms"]
    lines = ["| running | schedule + pack + update ms | schedule | pack | update | x batch-1 |", "|---|---|---|---|---|---|"]
    for b, r in per_batch.items():
        lines.append(f"| {b} | {r['host_ms']:.3f} | {r['schedule_ms']:.3f} | {r['pack_ms']:.3f} | "
                     f"{r['update_ms']:.3f} | {r['host_ms'] / first:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args()
    batches = sorted({int(b) for b in args.batch_sizes.split(",")})
    print(f"input_len {args.input_len}")
    print(table(measure(batches, args.input_len, args.steps, args.rounds, args.seed)))


if __name__ == "__main__":
    main()
