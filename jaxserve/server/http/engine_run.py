"""One HTTP request's engine streams: one per prompt (a completion may send several), merged into
one sequence of per-choice deltas, with the usage they add up to.

`start` waits for every prompt's first output before anything is sent, so a request the engine's
door refuses (a ValueError, a full queue) becomes an HTTP error status, not an error inside a 200
stream. Closing the run (the client disconnected, the stream ended) closes every engine stream,
which aborts its request before the next step, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.http.schemas import PromptTokensDetails, Usage
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.sample_deltas import SampleDelta, SampleDeltas

_END = object()


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    choice: int              # prompt index x n + sample index, OpenAI's choice index
    delta: SampleDelta


@dataclass
class _Prompt:
    index: int
    stream: AsyncIterator[RequestOutput]
    deltas: SampleDeltas
    arrival: float
    last: RequestOutput | None = None
    prompt_logprobs: list | None = None    # RequestOutput.prompt_logprobs, kept from the output that had them


@dataclass
class EngineRun:
    aengine: AsyncEngine
    params: SamplingParams
    metrics: ServerMetrics | None
    prompts: list[_Prompt] = field(default_factory=list)
    _queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @classmethod
    async def start(cls, aengine: AsyncEngine, prompts: list[Any], params: SamplingParams, *, request_id: str,
                    priority: int, metrics: ServerMetrics | None, arrival: float,
                    lora_request=None) -> "EngineRun":
        run = cls(aengine, params, metrics)
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            stream = aengine.generate(prompt, params, request_id=rid, priority=priority, arrival_time=arrival,
                                      lora_request=lora_request)
            run.prompts.append(_Prompt(i, stream, SampleDeltas(params.n), arrival))
        try:
            # return_exceptions: every first step ends before the streams are closed (a generator
            # cannot be closed while another task is inside it)
            firsts = await asyncio.gather(*(anext(p.stream, _END) for p in run.prompts), return_exceptions=True)
        except BaseException:   # cancelled (the client left): the children were cancelled too
            await run.close(refused=True)
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await run.close(refused=True)
            raise errors[0]
        for p, first in zip(run.prompts, firsts):
            if first is not _END:
                p.last = first         # the prompt's token counts are known before its deltas are read
                run._queue.put_nowait((p, first))
            if first is not _END and not first.finished:
                run._tasks.append(asyncio.ensure_future(run._pump(p)))
            else:
                run._queue.put_nowait((p, _END))
        return run

    async def _pump(self, p: _Prompt) -> None:
        try:
            async for out in p.stream:
                self._queue.put_nowait((p, out))
        except BaseException as e:   # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put_nowait((p, e))
            return
        self._queue.put_nowait((p, _END))

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas in the order the engine produced them, until all prompts end."""
        live = len(self.prompts)
        while live:
            p, item = await self._queue.get()
            if item is _END:
                live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            p.last = item
            if item.prompt_logprobs is not None:   # DELTA outputs carry them once
                p.prompt_logprobs = item.prompt_logprobs
            for d in p.deltas.deltas(item):
                yield ChoiceDelta(p.index * self.params.n + d.index, d)

    def usage(self) -> Usage:
        """Usage so far: every prompt's tokens, every sample's tokens, every prompt's cache hits."""
        prompt = sum(len(p.last.prompt_token_ids) for p in self.prompts if p.last is not None)
        completion = sum(sum(p.deltas.tokens) for p in self.prompts)
        cached = sum(p.last.num_cached_tokens for p in self.prompts if p.last is not None)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def close(self, *, refused: bool = False) -> None:
        """Abort what still runs (closing a stream aborts its request) and record the latencies of
        the requests that ran (not of those refused at the door)."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        for p in self.prompts:
            with contextlib.suppress(BaseException):
                await p.stream.aclose()
            if self.metrics is not None and not refused:
                self.metrics.observe(p.last.metrics if p.last is not None else None, arrival_time=p.arrival,
                                     ended_at=time.perf_counter())
