"""An asyncio load generator against any streaming endpoint (the gRPC server, later others).

The endpoint is an async callable `stream(prompt_token_ids, params) -> async iterator of
(new_token_ids, time)`: each item carries the tokens that arrived together and the
time.perf_counter() when they arrived. `params` is a dict: max_tokens, ignore_eos, temperature.
Requests are released by the same rules as every other driver (dispatch.py): send offsets,
groups, and a concurrency cap; the arrival time is when the request is sent. A request that
fails fails the run, unless the caller passes `failures`: a goodput sweep counts a rejected or
broken request as a miss and goes on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Sequence

from jaxserve.bench.dispatch import Dispatcher
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest

StreamFn = Callable[[list[int], dict[str, Any]], AsyncIterator[tuple[list[int], float]]]


async def run_load(stream: StreamFn, requests: Sequence[BenchRequest], max_concurrency: int | None = None,
                   progress: bool = True, failures: dict[str, str] | None = None,
                   ) -> tuple[list[RequestRecord], dict[str, list[int]], float]:
    """Send every request through `stream`; returns (records, output token ids, duration).

    With `failures` given, a request whose stream raises or yields no token is written there
    (request id -> reason) and has no record, instead of failing the run; duration is 0 when no
    request finished."""
    start = time.perf_counter()
    disp = Dispatcher(requests, start, max_concurrency)
    changed = asyncio.Event()
    done: dict[str, tuple[list[int], list[float], float]] = {}

    async def one(r: BenchRequest) -> None:
        toks: list[int] = []
        times: list[float] = []
        params = {"max_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0}
        try:
            async for ids, t in stream(list(r.prompt_token_ids), params):
                if ids and not toks:
                    disp.first_token(r.request_id, r.group, t)
                    changed.set()
                toks.extend(ids)
                times.extend([t] * len(ids))
            if not toks:
                raise RuntimeError(f"request {r.request_id} streamed no tokens")
        except Exception as e:
            if failures is None:
                raise
            failures[r.request_id] = f"{type(e).__name__}: {e}"
            disp.finished(r.request_id, time.perf_counter())   # its seat is free again
            changed.set()
            return
        end = time.perf_counter()
        done[r.request_id] = (toks, times, end)
        disp.finished(r.request_id, end)
        changed.set()

    tasks: set[asyncio.Task[None]] = set()
    with progress_bar(len(requests), "serve", progress) as bar:
        while disp.has_waiting or tasks:
            changed.clear()  # cleared before looking, so a notification after this point is never lost
            for r in disp.pop_due(time.perf_counter()):
                tasks.add(asyncio.create_task(one(r), name=r.request_id))
            nxt = disp.next_due()
            timeout = None if nxt is None else max(0.0, nxt - time.perf_counter())
            waiter = asyncio.create_task(changed.wait())
            finished, _ = await asyncio.wait(tasks | {waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for t in finished:
                if t in tasks:
                    tasks.discard(t)
                    t.result()  # a failed request fails the benchmark, loudly
                    bar.update(1)
            if not tasks and disp.has_waiting and nxt is None:
                raise RuntimeError("requests wait for a group that can never start")
    records = []
    for r in requests:
        if r.request_id not in done:
            continue   # failed, and written to `failures`
        toks, times, end = done[r.request_id]
        records.append(RequestRecord(
            request_id=r.request_id, prompt_len=len(r.prompt_token_ids), output_len=len(toks),
            arrival_time=disp.sent_at[r.request_id], first_token_time=times[0], finished_time=max(end, times[-1]),
            token_times=tuple(times), group=r.group))
    duration = (max(x.finished_time for x in records) - min(x.arrival_time for x in records)) if records else 0.0
    return records, {rid: v[0] for rid, v in done.items()}, duration
