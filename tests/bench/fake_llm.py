"""A deterministic stand-in for jaxserve's LLM with the same shape (generate, engine.step, stats).

It exists so the harness can be tested without compiling a model: each step admits waiting
requests up to `max_num_seqs`, computes a whole prompt or one decode token per running request,
and sleeps a little per token so timings are positive and ordered. Output token t of a request
is (sum(prompt) + t) % 97, so outputs are checkable.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from jaxserve.engine.stats import EngineStats
from tests.engine.idle_stats import idle_scheduler_stats


@dataclass(frozen=True)
class FakeParams:
    max_tokens: int
    ignore_eos: bool = True
    temperature: float = 0.0
    n: int = 1
    seed: int | None = None


@dataclass
class FakeMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class FakeCompletion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class FakeOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]
    finished: bool
    num_cached_tokens: int
    metrics: FakeMetrics


class FakeEngine:
    def __init__(self, max_num_seqs: int, block_size: int, num_blocks: int, sec_per_token: float,
                 prefix_caching: bool, max_model_len: int = 2048) -> None:
        self.max_num_seqs, self.block_size, self.num_blocks = max_num_seqs, block_size, num_blocks
        # what the bench reads of a real engine: its scheduler's block size and the context length
        self.scheduler = SimpleNamespace(config=SimpleNamespace(block_size=block_size))
        self.max_model_len = max_model_len
        self.sec_per_token = sec_per_token
        self.prefix_caching = prefix_caching
        self.waiting: list[tuple[str, list[int], FakeParams]] = []
        self.running: dict[str, FakeOutput] = {}
        self.params: dict[str, FakeParams] = {}
        self.seen_prefixes: set[tuple[int, ...]] = set()
        self._arrivals: dict[str, float] = {}
        self.steps = 0

    def add_request(self, request_id: str, prompt: dict, params: FakeParams, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        if params.n != 1:
            raise NotImplementedError("FakeLLM samples one sequence per request")
        ids = list(prompt["prompt_token_ids"])
        self.waiting.append((request_id, ids, params))
        self.params[request_id] = params
        self._arrivals[request_id] = time.perf_counter() if arrival_time is None else arrival_time

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError("cannot reset the prefix cache while requests are running")
        self.seen_prefixes.clear()

    def _cached(self, ids: list[int]) -> int:
        if not self.prefix_caching:
            return 0
        n = 0
        for end in range(self.block_size, len(ids), self.block_size):
            if tuple(ids[:end]) in self.seen_prefixes:
                n = end
        for end in range(self.block_size, len(ids) + 1, self.block_size):
            self.seen_prefixes.add(tuple(ids[:end]))
        return n

    def step(self) -> list[FakeOutput]:
        self.steps += 1
        now = time.perf_counter()
        work = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid, ids, _ = self.waiting.pop(0)
            cached = self._cached(ids)
            work += len(ids) - cached
            self.running[rid] = FakeOutput(rid, None, ids, [FakeCompletion(0, "", [])], False, cached,
                                           FakeMetrics(self._arrivals[rid], first_scheduled_time=now))
        work += len(self.running)
        time.sleep(self.sec_per_token * work)
        t = time.perf_counter()
        touched = []
        for rid, out in list(self.running.items()):
            toks = out.outputs[0].token_ids
            toks.append((sum(out.prompt_token_ids) + len(toks)) % 97)
            out.metrics.token_times.append(t)
            if out.metrics.first_token_time is None:
                out.metrics.first_token_time = t
            if len(toks) >= self.params[rid].max_tokens:
                out.finished = True
                out.outputs[0].finish_reason = "length"
                out.metrics.finished_time = t
                del self.running[rid]
            touched.append(out)
        return touched

    def used_blocks(self) -> int:
        return sum(math.ceil((len(o.prompt_token_ids) + len(o.outputs[0].token_ids)) / self.block_size)
                   for o in self.running.values())


class FakeLLM:
    def __init__(self, model: str | None = None, dtype: str = "float32", max_num_seqs: int = 8,
                 block_size: int = 16, num_kv_blocks: int = 512, max_model_len: int = 2048,
                 sec_per_token: float = 2e-5, enable_prefix_caching: bool = True, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.engine = FakeEngine(max_num_seqs, block_size, num_kv_blocks, sec_per_token, enable_prefix_caching,
                                 max_model_len=max_model_len)
        self.checkpoint_identity = "sha256:fake"

    def generate(self, prompts: list[dict], params: list[FakeParams], use_tqdm: bool = False) -> list[FakeOutput]:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            self.engine.add_request(f"gen-{id(p)}-{i}", p, sp)
        done: dict[str, FakeOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[f"gen-{id(p)}-{i}"] for i, p in enumerate(prompts)]

    def stats(self) -> EngineStats:
        used = self.engine.used_blocks()
        return EngineStats(idle_scheduler_stats(num_kv_blocks_total=self.engine.num_blocks,
                                                num_kv_blocks_free=self.engine.num_blocks - used,
                                                num_running=len(self.engine.running)))
