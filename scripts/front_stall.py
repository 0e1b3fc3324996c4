"""How long one huge prompt stalls another stream on a running `jaxserve serve` (issue 15, item 3).

    .venv/bin/jaxserve serve &                         # wait for "jaxserve ready"
    .venv/bin/python scripts/front_stall.py --mib 15 --repeats 3 [--pid PID]

Each round: stream A decodes greedily; once it has a few tokens, a prompt of --mib MiB of
English text is sent and refused; A keeps streaming a few more tokens and is cancelled. Prints,
per round, the refusal's status and latency, A's largest inter-token gap while the prompt was in
flight and its largest gap before it (the baseline), and, with --pid, the server's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from jaxserve.client import AsyncGenerationClient

SENTENCE = "The tide comes in and goes out twice a day, pulled by the moon. "


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


async def one_round(client: AsyncGenerationClient, big: str, settle: int) -> dict:
    times: list[float] = []
    enough = asyncio.Event()
    want = [settle]

    async def stream_a():
        async for chunk in client.stream_chunks([{"role": "user", "content": "Tell me a very long story."}],
                                                max_tokens=4000, temperature=0.0, ignore_eos=True):
            if chunk.token_ids:
                times.append(chunk.time)
                if len(times) >= want[0]:
                    enough.set()

    task = asyncio.ensure_future(stream_a())
    await enough.wait()
    enough.clear()
    t_send = time.perf_counter()
    try:
        await client.generate(big, max_tokens=1)
        status, details = "OK", ""
    except grpc.aio.AioRpcError as e:
        status, details = e.code().name, e.details()
    t_done = time.perf_counter()
    want[0] = len(times) + settle
    enough.clear()
    await enough.wait()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    gaps_during = [b - a for a, b in zip(times, times[1:]) if b > t_send and a < t_done]
    before = [t for t in times if t < t_send]
    gaps_before = [b - a for a, b in zip(before[1:], before[2:])]   # the first gap holds A's prefill
    return {"status": status, "details": details[:160], "refused_after_s": round(t_done - t_send, 3),
            "a_max_gap_during_s": round(max(gaps_during), 3) if gaps_during else None,
            "a_max_gap_before_s": round(max(gaps_before), 3) if gaps_before else None}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--mib", type=float, default=15.0, help="size of the refused prompt in MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=int, default=8, help="tokens A receives before and after the big prompt")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid, to report its RSS")
    args = ap.parse_args()
    size = int(args.mib * (1 << 20))
    big = (SENTENCE * (size // len(SENTENCE) + 1))[:size]
    async with AsyncGenerationClient(args.target, timeout=600) as client:
        print(json.dumps({"prompt_bytes": size, "rss_mib": rss_mib(args.pid)}), flush=True)
        for i in range(args.repeats):
            r = await one_round(client, big, args.settle)
            print(json.dumps({"round": i, **r, "rss_mib": rss_mib(args.pid)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
