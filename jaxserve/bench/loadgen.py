"""An asyncio load generator against any streaming endpoint (the gRPC server, an OpenAI-compatible
HTTP server).

The endpoint is an async callable `stream(prompt_token_ids, params) -> async iterator of
(new_token_ids, time)`: each item carries the tokens that arrived together and the
time.perf_counter() when they arrived. `params` is a dict: max_tokens, ignore_eos, temperature.
An endpoint that sees text, not token ids (HTTP: a chunk's text may hold several tokens), yields
a `TextChunk(time)` per chunk and ends with `TokenCount(n)`, the server's own count: the record
then has n output tokens and one time per chunk (`RequestRecord.chunked`), so its ITL is per chunk.
Requests are released by the same rules as every other driver (dispatch.py): send offsets,
groups, and a concurrency cap; the arrival time is when the request is sent. A request that
fails fails the run, unless the caller passes `failures`: a goodput sweep counts a rejected or
broken request as a miss and goes on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from jaxserve.bench.dispatch import Dispatcher
from jaxserve.bench.metrics import RequestRecord
from jaxserve.bench.progress import progress_bar
from jaxserve.bench.workloads import BenchRequest



@dataclass(frozen=True, slots=True)
class TextChunk:
    """A streamed chunk whose tokens the client cannot see: when it arrived (perf_counter)."""
    time: float


@dataclass(frozen=True, slots=True)
class TokenCount:
    """The last item of a stream of TextChunks: the output tokens the server says it generated."""
    output_tokens: int


StreamItem = tuple[list[int], float] | TextChunk | TokenCount
StreamFn = Callable[[list[int], dict[str, Any]], AsyncIterator[StreamItem]]


@dataclass(slots=True)
class _Received:
    """What one request's stream delivered so far."""
    token_ids: list[int]
    times: list[float]            # one per token, or one per TextChunk
    counted: int | None = None    # TokenCount's, for a stream of TextChunks
    chunked: bool = False

    def add(self, item: StreamItem) -> float | None:
        """Takes one item; returns its time when it is the first output to arrive."""
        first = not self.times
        if isinstance(item, TokenCount):
            self.counted = item.output_tokens
            return None
        if isinstance(item, TextChunk):
            self.chunked = True
            self.times.append(item.time)
            return item.time if first else None
        ids, t = item
        self.token_ids.extend(ids)
        self.times.extend([t] * len(ids))
        return t if ids and first else None

    def output_len(self, request_id: str) -> int:
        if not self.chunked:
            if not self.token_ids:
                raise RuntimeError(f"request {request_id} streamed no tokens")
            return len(self.token_ids)
        if self.counted is None:
            raise RuntimeError(f"request {request_id}: the stream ended without the server's token count (usage)")
        if self.counted < len(self.times) or self.counted == 0:
            raise RuntimeError(f"request {request_id}: the server counted {self.counted} tokens "
                               f"for {len(self.times)} non-empty chunks")
        return self.counted


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
    done: dict[str, tuple[_Received, int, float]] = {}

    async def one(r: BenchRequest) -> None:
        got = _Received([], [])
        params = {"max_tokens": r.output_len, "ignore_eos": True, "temperature": 0.0}
        try:
            async for item in stream(list(r.prompt_token_ids), params):
                t = got.add(item)
                if t is not None:
                    disp.first_token(r.request_id, r.group, t)
                    changed.set()
            n = got.output_len(r.request_id)
        except Exception as e:
            if failures is None:
                raise
            failures[r.request_id] = f"{type(e).__name__}: {e}"
            disp.finished(r.request_id, time.perf_counter())   # its seat is free again
            changed.set()
            return
        end = time.perf_counter()
        done[r.request_id] = (got, n, end)
        disp.finished(r.request_id, end)
        changed.set()

    tasks: set[asyncio.Task[None]] = set()
    with progress_bar(len(requests), "serve", progress) as bar:
        while disp.has_waiting or tasks:
            changed.clear()  # cleared before looking, so a notification after this point is never lost
            for r in disp.pop_due(time.perf_counter()):
                tasks.add(asyncio.create_task(one(r), name=r.request_id))
            nxt = disp.next_due()
            # a due request without a free seat waits for a seat (a finished request sets
            # `changed`), not for its due time, which is past: a zero timeout would spin a core
            # the servers under test need (it halved llama-server's decode speed on 2 cores)
            timeout = None if nxt is None or not disp.has_free_seat else max(0.0, nxt - time.perf_counter())
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
        got, n, end = done[r.request_id]
        records.append(RequestRecord(
            request_id=r.request_id, prompt_len=len(r.prompt_token_ids), output_len=n,
            arrival_time=disp.sent_at[r.request_id], first_token_time=got.times[0],
            finished_time=max(end, got.times[-1]), token_times=tuple(got.times), group=r.group,
            chunked=got.chunked))
    duration = (max(x.finished_time for x in records) - min(x.arrival_time for x in records)) if records else 0.0
    # a stream of text chunks has no token ids: no entry, so no cross-target agreement for it
    outputs = {rid: v[0].token_ids for rid, v in done.items() if not v[0].chunked}
    return records, outputs, duration
