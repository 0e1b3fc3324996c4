"""Engine: the step loop gluing the scheduler (host) and the model runner (device).

One `step()`: schedule -> runner.execute -> scheduler.update -> detokenize, stop strings ->
RequestOutputs for every request touched. Requests are validated at the door (`add_request`),
so nothing bad reaches the scheduler, and a bad request never stops the engine.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.input_processor import process_prompt
from jaxserve.engine.stats import EngineStats
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.runner.sampler import RowSampling
from jaxserve.sampling_params import OutputKind, SamplingParams
from jaxserve.sched.request import Request
from jaxserve.sched.scheduler import Scheduler


@dataclass(slots=True)
class _Group:
    """The n samples of one request (SamplingParams.n > 1): one scheduler request each, forked
    from the first so they share the prompt's KV blocks; one RequestOutput for all."""

    request_id: str
    members: list[str]
    completions: list[CompletionOutput | None]
    metrics: RequestMetrics
    params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int]
    num_finished: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _Tracked:
    """Engine-side state of one live request (the scheduler keeps the token-level state)."""

    request: Request
    params: SamplingParams
    prompt: str | None
    detok: IncrementalDetokenizer | None
    metrics: RequestMetrics
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0          # for DELTA outputs
    sent_text: int = 0
    group: _Group | None = None
    index: int = 0                # the sample's index within its group


@dataclass(slots=True)
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    finished_by_reason: dict = field(default_factory=dict)


class Engine:
    def __init__(self, *, scheduler: Scheduler, runner, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: Iterable[int], seed: int = 0, checkpoint_identity: str = "",
                 model_name: str = "", compilations_at_warmup: int | None = None,
                 compile_counter=None, chunk_policy=None):
        self.scheduler = scheduler
        self.chunk_policy = chunk_policy      # how the prefill chunk size was chosen (engine/chunk_policy.py)
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.checkpoint_identity = checkpoint_identity
        self.model_name = model_name
        self._rng = np.random.default_rng(seed)
        self._live: dict[str, _Tracked] = {}
        self._groups: dict[str, _Group] = {}
        self._ids = itertools.count()
        self._counters = _Counters()
        self._start = time.monotonic()
        self._compile_counter = compile_counter
        self._compilations_at_warmup = compilations_at_warmup

    # -- the door ----------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str | None, prompt: Any, params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises ValueError (bad input, with the numbers) or
        Overloaded (the waiting queue is full). n > 1 queues n samples sharing the prompt."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority={priority!r} must be an integer")
        request_id = self.new_request_id() if request_id is None else str(request_id)
        if request_id in self._live or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        p = process_prompt(prompt, params, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                           max_model_len=self.max_model_len)
        if params.stop_token_ids and any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids {params.stop_token_ids} contain ids outside [0, {self.vocab_size})")
        now = time.perf_counter() if arrival_time is None else arrival_time
        if params.n == 1:
            self._add_member(request_id, p, params, params.seed, priority, now, RequestMetrics(arrival_time=now))
        else:
            metrics = RequestMetrics(arrival_time=now)
            group = _Group(request_id, [f"{request_id}#{i}" for i in range(params.n)], [None] * params.n, metrics,
                           params, p.prompt, list(p.prompt_token_ids))
            for i, sub_id in enumerate(group.members):
                seed = None if params.seed is None else params.seed + i
                parent = group.members[0] if i else None
                self._add_member(sub_id, p, params, seed, priority, now, metrics, group=group, index=i,
                                 fork_of=parent)
            self._groups[request_id] = group
        self._counters.prompt_tokens += len(p.prompt_token_ids)
        return request_id

    def _add_member(self, sub_id, p, params, seed, priority, now, metrics, *, group=None, index=0, fork_of=None):
        seed = seed if seed is not None else int(self._rng.integers(0, 2**31))
        stop_ids = frozenset(params.stop_token_ids or ())
        banned = tuple(sorted((set() if params.ignore_eos else set(self.eos_token_ids)) | stop_ids))
        req = Request(sub_id, p.prompt_token_ids, p.max_tokens, min_tokens=params.min_tokens,
                      eos_token_ids=self.eos_token_ids, stop_token_ids=stop_ids, ignore_eos=params.ignore_eos,
                      priority=priority, arrival_time=now, cache_salt=p.cache_salt,
                      payload=RowSampling(params, seed, banned))
        if fork_of is None:
            self.scheduler.add_request(req)
        else:
            self.scheduler.fork_request(fork_of, req)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, p.prompt_token_ids,
                                           skip_special_tokens=params.skip_special_tokens, stop=params.stop,
                                           include_stop_str_in_output=params.include_stop_str_in_output)
        self._live[sub_id] = _Tracked(req, params, p.prompt, detok, metrics,
                                      logprobs=[] if params.logprobs is not None else None,
                                      cumulative_logprob=0.0 if params.logprobs is not None else None,
                                      group=group, index=index)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        subs = []
        for rid in ids:
            group = self._groups.pop(rid, None)
            subs.extend(group.members if group is not None else [rid])
        self.scheduler.abort_requests(subs)
        counted = set()
        for sub_id in subs:
            t = self._live.pop(sub_id, None)
            if t is not None:
                key = t.group.request_id if t.group is not None else sub_id
                if key not in counted:
                    counted.add(key)
                    self._count_finished("abort")

    # -- the loop ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        now = time.perf_counter()
        for r in sched_out.requests:
            t = self._live.get(r.request_id)
            if t is not None and t.metrics.first_scheduled_time is None:
                t.metrics.first_scheduled_time = now
        result = self.runner.execute(sched_out)
        sampled = {rid: s.token_id for rid, s in result.sampled.items()}
        updates = self.scheduler.update(sched_out, sampled)
        now = time.perf_counter()
        outputs = []
        stopped_by_string = []
        touched_groups: dict[str, _Group] = {}
        for u in updates:
            t = self._live.get(u.request.request_id)
            if t is None:
                continue
            if u.new_token_ids:
                self._counters.generation_tokens += len(u.new_token_ids)
                t.metrics.token_times.extend([now] * len(u.new_token_ids))
                if t.metrics.first_token_time is None:
                    t.metrics.first_token_time = now
                s = result.sampled.get(u.request.request_id)
                if t.logprobs is not None and s is not None:
                    self._record_logprobs(t, s)
                if t.detok is not None:
                    t.detok.append(u.new_token_ids)
                    if t.detok.stopped_by is not None and not u.finished:
                        stopped_by_string.append(u.request.request_id)
            finished = u.finished or (t.detok is not None and t.detok.stopped_by is not None)
            if finished and t.detok is not None and t.detok.stopped_by is not None:
                # a stop string ends the request even if the token also hit a limit
                u.request.finish_reason = "stop"
                u.request.stop_reason = t.detok.stopped_by
            if t.group is None:
                if finished:
                    t.metrics.finished_time = now
                out = self._make_output(t, finished)
                if out is not None:
                    outputs.append(out)
                if finished:
                    self._count_finished(u.request.finish_reason or "stop")
            else:
                g = t.group
                g.completions[t.index] = self._completion(t, finished, OutputKind.CUMULATIVE)
                g.num_cached_tokens = max(g.num_cached_tokens, t.request.num_cached_tokens)
                if finished:
                    g.num_finished += 1
                touched_groups[g.request_id] = g
            if finished:
                del self._live[u.request.request_id]
        for g in touched_groups.values():
            out = self._group_output(g, now)
            if out is not None:
                outputs.append(out)
        if stopped_by_string:
            self.scheduler.finish_requests(stopped_by_string, reason="stop")
        return outputs

    def _record_logprobs(self, t: _Tracked, s) -> None:
        k = t.params.logprobs
        entry = {s.token_id: Logprob(s.logprob)}
        for rank, (tid, lp) in enumerate(s.top_logprobs[:k], start=1):
            entry.setdefault(tid, Logprob(lp, rank))
        t.logprobs.append(entry)
        t.cumulative_logprob += s.logprob

    def _completion(self, t: _Tracked, finished: bool, kind: OutputKind) -> CompletionOutput:
        req = t.request
        ids = list(req.output_token_ids)
        text = t.detok.text if t.detok is not None else ""
        logprobs = t.logprobs
        if kind is OutputKind.DELTA:
            ids, text = ids[t.sent_tokens:], text[t.sent_text:]
            logprobs = logprobs[t.sent_tokens:] if logprobs is not None else None
            t.sent_tokens, t.sent_text = len(req.output_token_ids), len(t.detok.text if t.detok else "")
        return CompletionOutput(
            index=t.index, text=text, token_ids=ids,
            finish_reason=(req.finish_reason or "stop") if finished else None,
            stop_reason=req.stop_reason if finished else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            cumulative_logprob=t.cumulative_logprob)

    def _make_output(self, t: _Tracked, finished: bool) -> RequestOutput | None:
        kind = t.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not finished:
            return None
        req = t.request
        return RequestOutput(req.request_id, t.prompt, list(req.prompt_token_ids), [self._completion(t, finished, kind)],
                             finished, num_cached_tokens=req.num_cached_tokens, metrics=t.metrics)

    def _group_output(self, g: _Group, now: float) -> RequestOutput | None:
        done = g.num_finished == len(g.members)
        if done:
            g.metrics.finished_time = now
            self._groups.pop(g.request_id, None)
            self._count_finished(next((c.finish_reason for c in g.completions if c is not None), "stop"))
        completions = [c for c in g.completions if c is not None]
        if g.params.output_kind is OutputKind.FINAL_ONLY and not done:
            return None
        # n > 1 outputs are cumulative whatever the kind: each completion carries its index
        return RequestOutput(g.request_id, g.prompt, list(g.prompt_token_ids), completions, done,
                             num_cached_tokens=g.num_cached_tokens, metrics=g.metrics)

    def _count_finished(self, reason: str) -> None:
        self._counters.finished += 1
        self._counters.finished_by_reason[reason] = self._counters.finished_by_reason.get(reason, 0) + 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block (they return to the free pool)."""
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("cannot reset the prefix cache while requests are running")

    # -- introspection -----------------------------------------------------------------------
    @property
    def finished_by_reason(self) -> dict[str, int]:
        return dict(self._counters.finished_by_reason)

    def stats(self) -> EngineStats:
        s = self.scheduler
        after = 0
        if self._compile_counter is not None and self._compilations_at_warmup is not None:
            after = self._compile_counter() - self._compilations_at_warmup
        return EngineStats(
            num_kv_blocks_total=s.num_kv_blocks_total,
            num_kv_blocks_free=s.num_kv_blocks_free,
            num_kv_blocks_cached=s.num_kv_blocks_cached,
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions,
            num_compilations_after_warmup=after,
            prompt_tokens_total=self._counters.prompt_tokens,
            generation_tokens_total=self._counters.generation_tokens,
            prefix_cache_queries=getattr(s, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(s, "prefix_cache_hits", 0),
            num_requests_finished=self._counters.finished,
            uptime_s=time.monotonic() - self._start,
            num_preemptions_recompute=getattr(s, "num_preemptions_recompute", s.num_preemptions),
            num_preemptions_swap=getattr(s, "num_preemptions_swap", 0),
            num_swapped_blocks=getattr(s, "num_swapped_blocks", 0),
            prefill_chunk_tokens=s.config.long_prefill_token_threshold or s.config.decode_step_prefill_cap,
        )
