"""One embeddings request's inputs through the engine, a window at a time: the fair share of an
embedding request beside generation.

Each input is an engine request of its own (AsyncEngine.embed). Queued all at once, a body of
3,000 inputs put 3,000 requests ahead of every completion sent after it (first come, first served):
a 1-token completion beside it waited 88 s. Here at most `window` of a body's inputs are in the
engine at a time (`--embedding-window`, RequestCaps.embedding_window), the next one queued as
each finishes, so a later request waits behind at most a window's worth and shares steps that
carry at most that many of the body's prompts. The window trades the body's own speed for its
neighbours' latency (docs/benchmarks.md, "Embeddings beside completions": on the embedded model a
1-token completion beside 3,000 inputs took 1.8x its idle latency at window 2, 3.3x at 4, 5.5x at
16, while the 3,000 took 238, 156 and 104 s). Outputs come back in input order; the first failure
cancels (aborts) the inputs in flight, and none after it is queued. Both fronts (HTTP
/v1/embeddings and gRPC Embed) use it, after checking the body's size against
`RequestCaps.max_embedding_inputs`.
"""

from __future__ import annotations

import asyncio


def check_input_count(count: int, cap: int) -> None:
    """ValueError naming the cap for a body with more inputs than the server takes."""
    if count > cap:
        raise ValueError(f"the request holds {count} inputs; this server's limit is {cap} per request "
                         f"(--max-embedding-inputs)")


async def embed_windowed(aengine, prompts: list, params, *, window: int, request_id: str | None = None,
                         priority: int = 0, arrival_time: float | None = None) -> list:
    """Every prompt's EmbeddingRequestOutput, in order, at most `window` in the engine at once."""
    results: list = [None] * len(prompts)
    pending = iter(range(len(prompts)))
    in_flight: dict[asyncio.Future, int] = {}

    def start_next() -> None:
        i = next(pending, None)
        if i is not None:
            rid = f"{request_id}-{i}" if request_id else None
            task = asyncio.ensure_future(aengine.embed(prompts[i], params, request_id=rid, priority=priority,
                                                       arrival_time=arrival_time))
            in_flight[task] = i

    for _ in range(max(1, window)):
        start_next()
    try:
        while in_flight:
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = in_flight.pop(task)
                results[i] = task.result()      # the first failure raises here; finally cancels the rest
                start_next()
        return results
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)
